"""Note which of the functions that assignments stub ("file:function" or "file:Class.method") a run enters.

install(keys, note) makes each function call note(key) first, then run its own code: the function object
keeps its identity (its __code__ becomes a wrapper's, which finds the original through the module's
globals, and which names the original's file and first line, so that inspect.getsource still shows the
original), or, for a method with a __class__ cell (it calls super()), a wrapper replaces it on its class.
Used by the assignment kit's traced run (tests/test_assignments.py) and the notebooks' traced kernels
(tests/notebook_runs.py)."""
import functools
import importlib
import inspect
import types

WRAPPER = """def wrapper(*args, **kwargs):
    note, original = __noted__[{key!r}]
    note()
    return original(*args, **kwargs)
"""


def install(keys, note):
    for key in keys:
        file, _, name = key.partition(":")
        owner, *path, last = [importlib.import_module(file[:-3]), *name.split(".")]
        for part in path:
            owner = getattr(owner, part)
        live = inspect.unwrap(inspect.getattr_static(owner, last))
        original = types.FunctionType(live.__code__, live.__globals__, live.__name__, live.__defaults__,
                                      live.__closure__)
        original.__kwdefaults__ = live.__kwdefaults__
        live.__globals__.setdefault("__noted__", {})[key] = (lambda key=key: note(key), original)
        namespace = {}
        exec(WRAPPER.format(key=key), live.__globals__, namespace)
        if live.__code__.co_freevars:
            setattr(owner, last, functools.wraps(live)(namespace["wrapper"]))
        else:
            code = live.__code__
            names = dict(co_filename=code.co_filename, co_firstlineno=code.co_firstlineno, co_name=code.co_name)
            if hasattr(code, "co_qualname"):  # Python 3.11 and later
                names["co_qualname"] = code.co_qualname
            live.__code__ = namespace["wrapper"].__code__.replace(**names)
