"""What a student copy's notebooks run first (kit/make_assignment.py writes the cell that calls watch()):
every notebook runs top to bottom in a copy, its cells that need an assignment still to write saying so.

    import course
    from kit import notebook_guard
    notebook_guard.watch()

From then on, IPython runs each cell through a transformer (no cell of the reference notebooks knows of it):
- a cell that reaches a stub (its NotImplementedError("assignment N: ...")) prints one line, `this cell
  needs assignment N (its functions still to write), not done in this copy`, instead of a traceback, and
  the notebook goes on;
- a later cell that reads a name such a cell would have set (or changed) is not run: it prints the same
  line for the assignment that name waits for, and its own names wait too. A cell that sets a name
  again, and runs, frees it.
Where a model's own code is a stub (a stubbed `Class.__init__`: Medusa's heads before assignment 1), the
model is built all the same, from the rest of its code and its checkpoint: each unwritten part is a
stand-in that holds no weights and raises the stub's error when used (watch() installs it). So the
course's model loads in every copy, and a cell that only uses its base runs.
"""
import ast
import functools
import importlib
import sys

try:  # as a module of the kit package (a notebook imports it so); or with kit/ on sys.path (the kit's tests)
    from . import stubs
except ImportError:
    import stubs

SHELL_NAME = "__kit_notebook_guard__"


def _names(target) -> set[str]:
    """The names an assignment target binds (a, (a, b), [a, *b]); attribute and item targets bind none."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return set()


def _root(target) -> str | None:
    """The name whose object an attribute or item target changes (d[k] = v, m.x = v: d, m)."""
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


class Names(ast.NodeVisitor):
    """What a cell reads from earlier cells (a name read before the cell sets it), in the order the
    cell runs, what it sets (`binds`) and what objects it changes in place (`changes`). The names a
    function, lambda, class or comprehension reads but does not set count as read where it is defined."""

    def __init__(self):
        self.reads, self.binds, self.changes = set(), set(), set()

    def read(self, name):
        if name not in self.binds:
            self.reads.add(name)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.read(node.id)
        elif isinstance(node.ctx, ast.Del):
            self.changes.add(node.id)
        else:
            self.binds.add(node.id)

    def _scope(self, node, inner):
        """A nested scope: the names it reads that it does not set itself are read from here."""
        local = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
                local.add(sub.id)
            elif isinstance(sub, ast.arg):
                local.add(sub.arg)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
                local.add(sub.name)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                local |= {(a.asname or a.name).split(".")[0] for a in sub.names}
        for part in inner:
            for sub in ast.walk(part):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in local:
                    self.read(sub.id)

    def visit_FunctionDef(self, node):
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for decorator in node.decorator_list:
            self.visit(decorator)
        self._scope(node, node.body)
        self.binds.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for part in node.bases + node.keywords + node.decorator_list:
            self.visit(part)
        self._scope(node, node.body)
        self.binds.add(node.name)

    def visit_Lambda(self, node):
        for default in node.args.defaults:
            self.visit(default)
        self._scope(node, [node.body])

    def _comprehension(self, node):
        self.visit(node.generators[0].iter)  # evaluated where the comprehension stands
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        self._scope(node, parts + [g for gen in node.generators for g in [*gen.ifs]] +
                    [gen.iter for gen in node.generators[1:]])

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def _assign(self, targets, value):
        if value is not None:
            self.visit(value)
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                self.visit(target.value)  # d[k] = v reads d (and k)
                if isinstance(target, ast.Subscript):
                    self.visit(target.slice)
                root = _root(target)
                if root:
                    self.changes.add(root)
            else:
                for sub in ast.walk(target):  # a[i], b = ...: the subscripts read
                    if isinstance(sub, (ast.Attribute, ast.Subscript)):
                        self._assign([sub], None)
                self.binds |= _names(target)

    def visit_Assign(self, node):
        self._assign(node.targets, node.value)

    def visit_AnnAssign(self, node):
        self._assign([node.target], node.value)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self.read(node.target.id)
        self._assign([node.target], node.value)

    def visit_NamedExpr(self, node):
        self._assign([node.target], node.value)

    def visit_For(self, node):
        self.visit(node.iter)
        self._assign([node.target], None)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_With(self, node):
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self._assign([item.optional_vars], None)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncWith = visit_With

    def visit_ExceptHandler(self, node):
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.binds.add(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Import(self, node):
        self.binds |= {(a.asname or a.name).split(".")[0] for a in node.names}

    def visit_ImportFrom(self, node):
        self.binds |= {a.asname or a.name for a in node.names if a.name != "*"}

    def visit_Global(self, node):
        self.binds |= set(node.names)


def names(body) -> Names:
    found = Names()
    for stmt in body:
        found.visit(stmt)
    return found


class Guard(ast.NodeTransformer):
    """IPython's transformer of every cell, and what it remembers: the names that wait for an assignment."""

    def __init__(self, root=stubs.ROOT):
        self.waiting = {}  # name -> the assignment it waits for
        self.value = None
        self.stubbed = {}  # assignment -> its functions still stubs here
        for n, key, _ in stubs.stubs_in(root=root):
            self.stubbed.setdefault(n, []).append(key.partition(":")[2])

    def say(self, number):
        functions = ", ".join(self.stubbed.get(number, [])) or "its functions"
        print(f"this cell needs assignment {number} ({functions}), not done in this copy")

    # Called from the transformed cells

    def skip(self, number, binds, changes):
        """A cell not run: it reads a name that waits for assignment `number`."""
        self.say(number)
        for name in binds | changes:
            self.waiting.setdefault(name, number)

    def failed(self, error, binds, changes) -> bool:
        """A cell stopped by `error`: True (handled, one line said) when a stub raised it, or when it is
        a NameError for a name that waits; False (the notebook shows it) for anything else."""
        number = stubs.assignment_of(error) if isinstance(error, NotImplementedError) else \
            self.waiting.get(getattr(error, "name", None)) if isinstance(error, NameError) else None
        if number is None:
            return False
        self.say(number)
        if "matplotlib.pyplot" in sys.modules:  # a picture the cell left half drawn is not shown
            sys.modules["matplotlib.pyplot"].close("all")
        for name in binds | changes:
            self.waiting.setdefault(name, number)
        return True

    def ran(self, binds):
        for name in binds:
            self.waiting.pop(name, None)

    def keep(self, value):
        self.value = value

    def shown(self):
        value, self.value = self.value, None
        return value

    # The transformer

    def visit_Module(self, module):
        if not module.body:
            return module
        found = names(module.body)
        waits = sorted({self.waiting[name] for name in found.reads if name in self.waiting})
        me = ast.Name(SHELL_NAME, ast.Load())

        def call(method, *args):
            return ast.Expr(ast.Call(ast.Attribute(me, method, ast.Load()), list(args), []))

        binds = ast.Set([ast.Constant(n) for n in sorted(found.binds)]) if found.binds else \
            ast.Call(ast.Name("set", ast.Load()), [], [])
        changes = ast.Set([ast.Constant(n) for n in sorted(found.changes)]) if found.changes else \
            ast.Call(ast.Name("set", ast.Load()), [], [])
        if waits:
            module.body = [call("skip", ast.Constant(waits[0]), binds, changes)]
            return ast.fix_missing_locations(module)
        body, last = module.body, None
        if isinstance(body[-1], ast.Expr):  # the value IPython shows: kept, then shown outside the try
            body, last = body[:-1] + [call("keep", body[-1].value)], body[-1]
        error = "__kit_error__"
        handler = ast.ExceptHandler(
            ast.Tuple([ast.Name("NotImplementedError", ast.Load()), ast.Name("NameError", ast.Load())], ast.Load()),
            error, [ast.If(ast.UnaryOp(ast.Not(), ast.Call(ast.Attribute(me, "failed", ast.Load()),
                                                           [ast.Name(error, ast.Load()), binds, changes], [])),
                           [ast.Raise(exc=None, cause=None)], [])])
        guarded = ast.Try(body, [handler], [call("ran", binds)], [])
        module.body = [guarded] + ([ast.copy_location(call("shown"), last)] if last is not None else [])
        return ast.fix_missing_locations(module)


def stand_in(cls, key):
    """Build instances of `cls` (an nn.Module whose __init__ is a stub here) without their own code: the
    module's base __init__ runs, and the instance becomes a stand-in that holds no weights, loads none
    from a checkpoint, and raises the stub's error when it is used (called, or asked for a part)."""
    stubbed = cls.__init__

    @functools.wraps(stubbed)
    def __init__(self, *args, **kwargs):
        try:
            stubbed(self, *args, **kwargs)
        except NotImplementedError as e:
            if stubs.assignment_of(e) is None:
                raise
            super(cls, self).__init__()
            self.__dict__["_kit_stub_error"] = str(e)
            self.__dict__["_parameters"] = _NoParameters(str(e))  # an optimizer, a count or a copy of them: the error
            self.__class__ = _stand_in_class(cls)

    cls.__init__ = __init__


class _NoParameters(dict):
    """A stand-in's parameters: none, and asking for them (iterating) raises its stub's error."""

    def __init__(self, message):
        super().__init__()
        self.message = message

    def _unwritten(self, *args):
        raise NotImplementedError(self.message)

    items = values = keys = __iter__ = _unwritten


@functools.cache
def _stand_in_class(cls):
    def unwritten(self, *args, **kwargs):
        raise NotImplementedError(self.__dict__["_kit_stub_error"])

    def __getattr__(self, name):
        if name.startswith("_"):
            return cls.__getattr__(self, name)  # torch's own lookups (parameters, buffers, hooks)
        raise NotImplementedError(self.__dict__["_kit_stub_error"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        pass  # its weights stay in the checkpoint: nothing here holds them

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _apply(self, fn, recurse=True):
        return self  # moved or cast with its model: it holds nothing to move

    return type(f"Unwritten{cls.__name__}", (cls,), dict(
        forward=unwritten, __getattr__=__getattr__, _load_from_state_dict=_load_from_state_dict,
        _save_to_state_dict=_save_to_state_dict, _apply=_apply, __module__=cls.__module__))


def watch(shell=None, root=stubs.ROOT):
    """Run every later cell of this notebook through the guard, and let models whose own code is a stub
    here be built as stand-ins. Once per kernel; again does nothing."""
    shell = shell or get_ipython()  # noqa: F821  (IPython's)
    if any(isinstance(t, Guard) for t in shell.ast_transformers):
        return
    guard = Guard(root)
    shell.user_ns[SHELL_NAME] = guard
    shell.ast_transformers.append(guard)
    for number, key, _ in stubs.stubs_in(root=root):
        file, _, name = key.partition(":")
        if name.endswith(".__init__") and name.count(".") == 1:
            cls = getattr(importlib.import_module(file[:-3]), name.split(".")[0])
            import torch
            if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
                stand_in(cls, key)
    if guard.stubbed:
        print(f"In this copy, assignment{'s' if len(guard.stubbed) > 1 else ''} "
              f"{', '.join(map(str, sorted(guard.stubbed)))} {'are' if len(guard.stubbed) > 1 else 'is'} still to "
              f"write: a cell that needs one says so in one line and is skipped.")
