"""Which of the functions the assignments stub each graded test reaches, learned by running the tests
(`python kit/make_assignment.py --list` prints the tests each assignment gets from it).

The graded files (`graded` in kit/assignments.toml) run once, in a fresh process of their own, in the
project as it is, with every function an assignment stubs wrapped to note its name when it is called
(the function keeps its identity: its code is swapped, so every reference to it notes). A test reaches
what it calls in its setup, its call and its teardown, and also:
- what its fixtures called when they were set up, however long ago (a session fixture built for an
  earlier test is still this test's);
- what a cached call computed when it ran (functools.cache and lru_cache: a model trained once and handed
  to every test that asks, a tree's buffers built once): the project's caches are made, for this run,
  by a cache that remembers what each entry's computation reached and notes it again on every hit;
- what its test file called at import.
A call outside all of these (a core module or conftest.py calling a stubbed function at import) is
listed apart (`outside`): in a copy that module would not import.

Then a test in a copy with assignment N stubbed fails with N's error exactly when it reaches one of
N's functions; every other test runs there as it runs here. So the test lists of an assignment are
derived from the map (grading.load_assignments), not kept by hand, and a test added to a graded file
grades the assignments it reaches. The map is cached in out/kit/, keyed by a digest of the project's
code and tests and of the stubs' names: a change to any of them runs the tests again.
"""
import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import types

KIT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(KIT)
MAPPING = "kit/assignments.toml"
CACHE = "out/kit"


def _mapping(root) -> dict:
    with open(os.path.join(root, MAPPING), "rb") as f:
        return tomllib.load(f)


def stub_keys(mapping: dict) -> list[str]:
    """Every "file:function" an assignment stubs, in the mapping's order."""
    return [key for a in mapping["assignment"].values() for key in a["stubs"]]


def code_files(root) -> list[str]:
    """The files whose content decides what the graded tests reach: the project's Python code and
    tests (root, lab/, tests/), not the kit's."""
    found = []
    for folder in ("", "lab", "tests"):
        path = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in {"__pycache__", "private"} and not d.startswith("."))
            if folder == "":
                dirnames[:] = []  # the root's own files only: lab/ and tests/ are walked apart
            found += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(found)


def digest(root=ROOT, mapping=None) -> str:
    mapping = mapping or _mapping(root)
    h = hashlib.sha256(json.dumps([mapping.get("graded", []), stub_keys(mapping)]).encode())
    for name in code_files(root):
        h.update(name.encode() + b"\0")
        with open(os.path.join(root, name), "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()[:20]


def cache_path(root=ROOT, mapping=None) -> str:
    """Where the map of the code as it is now is kept: out/kit/reach-DIGEST.json."""
    return os.path.join(root, CACHE, f"reach-{digest(root, mapping)}.json")


def _writer(root, path):
    """The command that traces the project and writes its map to `path` (a process of its own)."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the graded tests use no plugin
    code = (f"import sys; sys.path.insert(0, {os.path.join(os.path.abspath(root), 'kit')!r}); import reach; "
            f"reach.write_locked({os.path.abspath(root)!r}, {path!r})")
    return dict(args=[sys.executable, "-c", code], cwd=root, env=env)


def start(root=ROOT, mapping=None):
    """Begin learning the map in the background, unless it is kept already: a process is started and left to
    run (None when there is nothing to do). reach_map() then waits for it rather than starting again."""
    path = cache_path(root, mapping)
    if os.path.exists(path):
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path[:-len(".json")] + ".log", "a") as log:
        return subprocess.Popen(**_writer(root, path), stdout=log, stderr=log)


def reach_map(root=ROOT, mapping=None, note=None) -> dict:
    """The map for the project at `root`: {"tests": {nodeid: [stub keys it reaches]}, "outcomes": {nodeid:
    "passed", "skipped" or why it failed}, "measures": {nodeid: what it recorded}, "outside": [keys called
    outside any test], ...}. Read from out/kit/ when this code has been traced already; else traced now,
    in a new process (or, when one is tracing already, once it has: a lock keeps two from tracing at once).
    note: called with one line before a run of the tests."""
    mapping = mapping or _mapping(root)
    path = cache_path(root, mapping)
    if not os.path.exists(path):
        if note:
            note(f"learning which tests reach which assignment: one run of {len(mapping.get('graded', []))} "
                 f"graded files (kept in {CACHE}/)")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        proc = subprocess.run(**_writer(root, path), capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"tracing the graded tests failed (status {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_locked(root, path):
    """Trace and write the map to `path`, holding out/kit/.lock; if another process wrote it meanwhile, nothing."""
    import fcntl
    with open(os.path.join(os.path.dirname(path), ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be tracing the same code: wait for it
        if not os.path.exists(path):
            write_json(path, trace(root))


# ----------------------------------------------------------------------------------------------
# The traced run (in a process of its own: the project's modules are imported after the caches are patched)

class Notes:
    """Where a wrapped function's call is noted: every open frame (the test running, the fixture or the
    test file being set up, the cached call being computed), or `outside` when none is open."""

    def __init__(self):
        self.frames, self.outside = [], set()

    def note(self, keys):
        if not self.frames:
            self.outside |= set(keys)
        for frame in self.frames:
            frame |= set(keys)

    @contextlib.contextmanager
    def frame(self):
        seen = set()
        self.frames.append(seen)
        try:
            yield seen
        finally:
            del self.frames[next(i for i, f in enumerate(self.frames) if f is seen)]


NOTES = Notes()


def remembering_lru_cache(original, root):
    """functools.lru_cache as the project's code gets it in this run: a project function's cache notes
    again, on every hit, what its entry's computation reached. Others keep the real cache."""
    project = os.path.abspath(root) + os.sep
    kit = os.path.abspath(KIT) + os.sep

    def lru_cache(maxsize=128, typed=False):
        if callable(maxsize) and not isinstance(maxsize, bool):  # used bare: @lru_cache
            return lru_cache()(maxsize)

        def decorate(function):
            module = sys.modules.get(getattr(function, "__module__", None))
            where = os.path.abspath(getattr(module, "__file__", None) or os.sep)
            if not where.startswith(project) or where.startswith(kit):
                return original(maxsize, typed)(function)
            values, reached = {}, {}

            @functools.wraps(function)
            def cached(*args, **kwargs):
                key = functools._make_key(args, kwargs, typed)
                if key in values:
                    NOTES.note(reached[key])
                    return values[key]
                with NOTES.frame() as seen:
                    value = function(*args, **kwargs)
                values[key], reached[key] = value, seen
                return value
            def forget_reaching(keys):
                """Drop the entries whose computation reached one of `keys` (a fault planted there changes them)."""
                for key in [k for k, seen in reached.items() if seen & set(keys)]:
                    del values[key], reached[key]
            cached.cache_clear = lambda: (values.clear(), reached.clear())
            cached.cache_info = lambda: functools._CacheInfo(0, 0, maxsize, len(values))
            cached.forget_reaching = forget_reaching
            return cached
        return decorate
    return lru_cache


WRAPPER = """
def wrapper(*args, **kwargs):
    note, original = __kit_reach__[{key!r}]
    note()
    return original(*args, **kwargs)
"""


def running(key: str, live):
    """The function object whose code runs when `key` is called: `live` itself, or, where wrap() put a
    wrapper in front of it, the copy of it the wrapper calls."""
    return live.__globals__.get("__kit_reach__", {}).get(key, (None, live))[1]


def instrument(root=ROOT, keys=()):
    """Make this process note what the project's code reaches: its functools caches remember it per entry,
    and the functions `keys` note their names (wrap). Before any project module is imported; True if so,
    False (nothing done) where one already is."""
    root = os.path.abspath(root) + os.sep
    if any(os.path.abspath(getattr(m, "__file__", None) or os.sep).startswith(root) and
           not os.path.abspath(m.__file__).startswith(KIT + os.sep) for m in list(sys.modules.values())):
        return False
    functools.lru_cache = remembering_lru_cache(functools.lru_cache, root)
    if root.rstrip(os.sep) not in sys.path:
        sys.path.insert(0, root.rstrip(os.sep))
    for key in keys:
        wrap(key)
    return True


def wrap(key: str):
    """Make the stubbed function `key` ("file:Class.method") note its key whenever it is called. Its code
    becomes a wrapper's that calls a copy of it, so every reference to it (imported by name elsewhere)
    notes; a function with a closure (a method that calls super()) is replaced on its class instead."""
    import importlib
    import inspect
    file, _, name = key.partition(":")
    owner, *path, last = [importlib.import_module(file[:-3]), *name.split(".")]
    for part in path:
        owner = getattr(owner, part)
    live = inspect.unwrap(inspect.getattr_static(owner, last))
    original = types.FunctionType(live.__code__, live.__globals__, live.__name__, live.__defaults__, live.__closure__)
    original.__kwdefaults__ = live.__kwdefaults__
    live.__globals__.setdefault("__kit_reach__", {})[key] = (lambda: NOTES.note({key}), original)
    namespace = {}
    exec(WRAPPER.format(key=key), live.__globals__, namespace)
    if live.__code__.co_freevars:
        setattr(owner, last, functools.wraps(live)(namespace["wrapper"]))
    else:
        live.__code__ = namespace["wrapper"].__code__


def tracer():
    """A pytest plugin: what each test reached (its frame, its fixtures', its file's import) and its outcome."""
    import pytest

    class Tracer:
        def __init__(self):
            self.tests, self.outcomes, self.measures, self.fixtures, self.files = {}, {}, {}, {}, {}

        @pytest.hookimpl(hookwrapper=True)
        def pytest_make_collect_report(self, collector):
            with NOTES.frame() as seen:  # a test file is imported while it is collected
                yield
            if isinstance(collector, pytest.Module):
                self.files[collector.nodeid] = seen

        @pytest.hookimpl(hookwrapper=True)
        def pytest_fixture_setup(self, fixturedef, request):
            with NOTES.frame() as seen:
                yield
            self.fixtures.setdefault((id(fixturedef), getattr(request, "param_index", 0)), set()).update(seen)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            with NOTES.frame() as seen:
                yield
            indices = getattr(getattr(item, "callspec", None), "indices", {})
            for name in item.fixturenames:
                for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                    seen |= self.fixtures.get((id(fixturedef), indices.get(name, 0)), set())
            seen |= self.files.get(item.nodeid.split("::")[0], set())
            self.tests[item.nodeid] = seen

        def pytest_runtest_logreport(self, report):
            if report.user_properties:  # what an efficiency test measured (record_property)
                self.measures.setdefault(report.nodeid, {}).update(report.user_properties)
            if self.outcomes.get(report.nodeid, "passed") != "passed":
                return  # the first problem (a setup error, then no call)
            if report.failed:
                self.outcomes[report.nodeid] = f"failed ({report.when}): {report.longreprtext.strip().splitlines()[-1]}"
            else:
                self.outcomes[report.nodeid] = "skipped" if report.skipped else "passed"

        def pytest_collectreport(self, report):
            if report.failed:
                self.outcomes[report.nodeid] = f"does not collect: {report.longreprtext.strip().splitlines()[-1]}"
    return Tracer()


def trace(root=ROOT) -> dict:
    """Run the graded files in this process with every stubbed function noted (see the module's doc).
    Call it in a fresh process: the project's modules must not be imported yet."""
    root = os.path.abspath(root)
    mapping = _mapping(root)
    os.chdir(root)
    keys = stub_keys(mapping)
    if not instrument(root, keys):
        raise RuntimeError("trace() must run in a fresh process: the project's modules are imported already")
    import pytest
    plugin = tracer()
    files = [f for f in mapping.get("graded", []) if os.path.exists(os.path.join(root, f))]
    with contextlib.redirect_stdout(sys.stderr):
        pytest.main(["-o", "addopts=", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception", *files],
                    plugins=[plugin])
    order = {key: i for i, key in enumerate(keys)}
    return dict(digest=digest(root, mapping), graded=files, stubs=keys,
                tests={nodeid: sorted(seen, key=order.get) for nodeid, seen in plugin.tests.items()},
                outcomes=plugin.outcomes, measures=plugin.measures, outside=sorted(NOTES.outside, key=order.get))


def write_json(path, data):
    """Atomically: a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
