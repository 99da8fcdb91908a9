"""The assignment kit's machinery: functions found by name (make_assignment.py stubs them), which
tests grade an assignment and which wait for a later one, running them in this process, and the
mutation check that plants known bugs. The commands kit/grade.py and kit/make_assignment.py use it;
see docs/instructors.md and kit/tests/README.md.

An assignment is graded for correctness (its `tests`: it passes when they all pass) and, apart,
for efficiency (its `efficiency` tests: what a step costs, measured and reported, never failed).
In the project, both lists come from running the graded files (kit/reach.py: the tests that reach the
assignment's functions); a copy's kit/assignments.toml has them written in (make_assignment.py).
A stub is one line, `raise NotImplementedError("assignment N: name: nudge")` (kit/stubs.py reads it).
The kit imports nothing from the lab but in make_assignment.copy_trained_runs.
"""
import ast
import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
import tomllib
from unittest import mock

KIT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(KIT)  # the project: the kit is one folder down
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import reach  # noqa: E402  (the kit's own modules, imported by bare name: the kit's folder is on sys.path)
import stubs  # noqa: E402

MAPPING = "kit/assignments.toml"
MUTANTS = "kit/mutants.toml"  # instructors only: never copied into a student version


class UsageError(Exception):
    """A mistake of the person running a kit command: one line, `error: ...`, exit status 2."""


class RunError(Exception):
    """A kit command that cannot go on, for a reason its user can act on: one line, exit status 1."""


def check_writable(folder):
    """Try a write in `folder` before long work: a read-only or full one is one line now (RunError)."""
    probe = os.path.join(folder, ".writable")
    try:
        with open(probe, "w") as f:
            f.write("ok\n")
        os.remove(probe)
    except OSError as e:
        raise RunError(f"cannot write in {folder}: {(e.strerror or str(e)).lower()}") from None


def write_json(path, data, **kwargs):
    """Atomically (a reader never sees half a file); a RunError, one line, when the disk refuses."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, **kwargs)
        os.replace(tmp, path)
    except OSError as e:
        raise RunError(f"cannot write {path}: {(e.strerror or str(e)).lower()}") from None


# ----------------------------------------------------------------------------------------------
# Functions by name, found with ast (make_assignment.py rewrites their bodies; here: is it a stub?)

def find_function(module: ast.Module, name: str) -> ast.FunctionDef:
    """The def called `name` ("function" or "Class.method") at the top level of a module."""
    *classes, func = name.split(".")
    scope = module.body
    for cls in classes:
        node = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if node is None:
            raise LookupError(f"no class {cls!r} for {name!r}")
        scope = node.body
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func), None)
    if node is None:
        raise LookupError(f"no function {name!r}")
    return node


def _has_docstring(func) -> bool:
    first = func.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def body_range(source: str, name: str) -> tuple[int, int, str]:
    """Lines [start, end) (0-based) of the body of `name` after its docstring, and the body's indent."""
    lines = source.splitlines(keepends=True)
    func = find_function(ast.parse(source), name)
    first = func.body[0]
    indent = lines[first.lineno - 1][:first.col_offset]
    if indent.strip():
        raise ValueError(f"{name}: the body must start on its own line, not after the colon")
    if _has_docstring(func):
        start = first.end_lineno  # the line after the docstring's closing quotes
        if len(func.body) > 1 and func.body[1].lineno == first.end_lineno:
            raise ValueError(f"{name}: a statement shares the docstring's last line")
    else:
        start = first.lineno - 1
    return start, func.end_lineno, indent


def get_body(source: str, name: str) -> list[str]:
    """The source lines of `name`'s body after its docstring."""
    start, end, _ = body_range(source, name)
    return source.splitlines(keepends=True)[start:end]


def replace_body(source: str, name: str, new_body: list[str]) -> str:
    """`source` with the body of `name` after its docstring replaced by the lines `new_body`."""
    start, end, _ = body_range(source, name)
    lines = source.splitlines(keepends=True)
    return "".join(lines[:start] + new_body + lines[end:])


def is_stub(source: str, name: str) -> bool:
    """Is the body of `name`, after its docstring, one `raise NotImplementedError("assignment ...")`?"""
    return stubs.stub_message(find_function(ast.parse(source), name)) is not None


def stubbed_here(number, root=ROOT) -> bool:
    """Is any function of assignment `number` still a stub in the copy at `root`?"""
    return not stubs.written(int(number), root)


# ----------------------------------------------------------------------------------------------
# The mapping: which tests grade an assignment now, and which wait for a later one

def load_mapping(path=os.path.join(ROOT, MAPPING)) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def compress(nodeids: list[str], every: list[str]) -> list[str]:
    """Node ids as a test list says them: a test's name where all its cases (of `every`) are there, else
    the cases, in the order of `nodeids`."""
    cases = {}
    for nodeid in every:
        cases.setdefault(nodeid.split("[")[0], []).append(nodeid)
    out = []
    for nodeid in nodeids:
        name = nodeid.split("[")[0]
        whole = set(cases.get(name, [nodeid])) <= set(nodeids)
        item = name if whole else nodeid
        if item not in out:
            out.append(item)
    return out


def tests_from_reach(mapping: dict, data: dict) -> dict:
    """The assignments of `mapping`, each with `tests` and `efficiency` from a reach map (kit/reach.py): the
    graded tests that reach one of its functions; those the mapping names under `efficiency` are its
    efficiency tests, the others its correctness tests."""
    every = list(data["tests"])
    out = {}
    for n, a in mapping["assignment"].items():
        reached = [t for t, keys in data["tests"].items() if set(keys) & set(a["stubs"])]
        efficiency = [t for t in reached if any(matches(t, s) for s in mapping.get("efficiency", []))]
        out[n] = dict(a, tests=compress([t for t in reached if t not in efficiency], every),
                      efficiency=compress(efficiency, every))
    return out


def load_assignments(mapping: dict | None = None, root=ROOT, note=None, data=None) -> dict:
    """The assignments, each with its tests: as a copy's assignments.toml lists them, or, in the project
    (no lists), from the reach map (data; else read from out/kit/, or traced now: note is told)."""
    mapping = mapping or load_mapping(os.path.join(root, MAPPING))
    if all("tests" in a for a in mapping["assignment"].values()):
        return mapping["assignment"]
    return tests_from_reach(mapping, data if data is not None else reach.reach_map(root, mapping, note=note))


def matches(nodeid: str, spec: str) -> bool:
    """Does a collected test belong to a spec: a node id, a test name (all its cases), or a file?"""
    return nodeid == spec or nodeid.startswith(spec + "[") or nodeid.startswith(spec + "::")


def _specs(assignment: dict) -> list[str]:
    """Every test the assignment runs: correctness (public and private), then efficiency."""
    return assignment.get("tests", []) + assignment.get("private", []) + assignment.get("efficiency", [])


def waiting(assignments: dict, n: str, later_stubbed=None) -> dict[str, str]:
    """{spec: m} for the tests of assignment n (correctness or efficiency) that also grade a later
    assignment m whose functions are stubs (default: those still stubs in this copy). They cannot
    pass before m is done."""
    order = list(assignments)
    if later_stubbed is None:
        later_stubbed = [m for m in order[order.index(n) + 1:] if stubbed_here(m)]
    out = {}
    for spec in _specs(assignments[n]):
        for m in later_stubbed:
            if any(matches(spec, t) or matches(t, spec) for t in _specs(assignments[m])):
                out.setdefault(spec, m)
    return out


def graded_in_sequence(assignments: dict, n: str, key: str = "tests") -> list[str]:
    """The tests of n (key: "tests" for correctness, "efficiency") that a student version handed out in
    sequence runs: every later assignment stubbed."""
    later = list(assignments)[list(assignments).index(n) + 1:]
    wait = waiting(assignments, n, later)
    return [t for t in assignments[n].get(key, []) if t not in wait]


def is_efficiency_test(assignments: dict, spec: str) -> bool:
    """Is `spec` (or a test it covers, or one covering it) an efficiency test of any assignment?"""
    return any(matches(spec, t) or matches(t, spec) for a in assignments.values() for t in a.get("efficiency", []))


# ----------------------------------------------------------------------------------------------
# Running tests in this process

def _message(text: str) -> str:
    """One line saying why a test failed, from its report's longreprtext: where (file:line) and the error,
    and for a failed pytest.raises(match=...) what it expected and what it got."""
    block = text.split("During handling of the above exception, another exception occurred:")[-1]
    lines = [line for line in block.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    where = [re.match(r"(\S+:\d+)", line).group(1) for line in lines if re.match(r"\S+:\d+: ", line)]
    if not errors:
        return (lines or [""])[-1].strip()
    details = [e for e in errors[1:] if re.match(r"(Regex|Input|Expected regex|Actual message):", e)]
    return (f"{where[-1]}: " if where else "") + errors[0] + (f" {'; '.join(details)}" if details else "")


class _Recorder:
    """pytest plugin: keeps only the tests matching the specs and records each one's outcome."""

    def __init__(self, specs, in_spec_order=False):
        self.specs = specs
        self.in_spec_order = in_spec_order
        self.cases = {}           # nodeid -> {"outcome", "message", "measures"}
        self.collect_errors = {}  # file -> message

    def _rank(self, item):
        return next((i for i, s in enumerate(self.specs) if matches(item.nodeid, s)), None)

    def pytest_collection_modifyitems(self, config, items):
        wanted = [self._rank(item) is not None for item in items]
        config.hook.pytest_deselected(items=[item for item, w in zip(items, wanted) if not w])
        items[:] = [item for item, w in zip(items, wanted) if w]
        if self.in_spec_order:
            items.sort(key=self._rank)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors[report.nodeid] = _message(report.longreprtext)

    def pytest_runtest_logreport(self, report):
        case = self.cases.setdefault(report.nodeid, {"outcome": "passed", "message": "", "measures": {}})
        case["measures"].update(report.user_properties)  # what an efficiency test recorded, pass or fail
        if case["outcome"] != "passed":
            return  # keep the first problem (a setup error, then the call is not run)
        if report.failed:
            case.update(outcome="failed" if report.when == "call" else "error", message=_message(report.longreprtext))
        elif report.skipped:
            case.update(outcome="skipped", message=_message(report.longreprtext))


def run_tests(specs, pytest_args=(), in_spec_order=False, root=ROOT, plugins=()) -> dict[str, dict]:
    """Run the tests matching `specs` (node ids, test names or files) of the project at `root`, in this process.

    Returns {nodeid: {"outcome": passed/failed/error/skipped, "message": one line, "measures": what
    the test recorded with record_property}}. A spec whose file does not import, or that matches
    nothing, gets one entry under its own name, "not run: why".
    in_spec_order: run in the order of `specs` rather than the files' (to fail fast with -x)."""
    import pytest
    here = os.getcwd()
    os.chdir(root)
    files = sorted({s.split("::")[0] for s in specs if os.path.exists(s.split("::")[0])})
    recorder = _Recorder(specs, in_spec_order)
    try:
        if files:  # pytest with no paths would run the whole suite
            # Options of our own, not pytest.ini's addopts, and no plugin that happens to be installed: grading
            # depends on neither (the graded tests use none), and loading them slows every run; nor the
            # unraisable-exception plugin, whose gc.collect() calls cost about a second a run.
            with contextlib.redirect_stdout(io.StringIO()), mock.patch.dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"):
                pytest.main(["-o", "addopts=", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                             "--continue-on-collection-errors", *pytest_args, *files], plugins=[recorder, *plugins])
    finally:
        os.chdir(here)
    cases = dict(recorder.cases)
    for spec in specs:
        if not any(matches(nodeid, spec) for nodeid in cases) and "-x" not in pytest_args:
            file = spec.split("::")[0]
            why = (f"{file} does not import: {recorder.collect_errors[file]}" if file in recorder.collect_errors
                   else "no such test" if os.path.exists(os.path.join(root, file)) else "no such file")
            cases[spec] = {"outcome": "error", "message": f"not run: {why}", "measures": {}}
    return cases


# ----------------------------------------------------------------------------------------------
# Grading

def grade(assignments: dict, numbers, pytest_args=()) -> list[dict]:
    """Run the tests of the given assignments once. Per assignment: one row per correctness test,
    `correct` (= `passed`, the exit status) when they all pass; and apart, `efficiency`: one row per
    efficiency test, what they measured and a one-line summary. Efficiency never fails an assignment."""
    wait = {n: waiting(assignments, n) for n in numbers}

    def runnable(n, specs):  # not waiting for a later assignment, and in this copy
        return [s for s in specs if s not in wait[n] and os.path.exists(os.path.join(ROOT, s.split("::")[0]))]
    correctness = {n: runnable(n, assignments[n]["tests"] + assignments[n].get("private", [])) for n in numbers}
    efficiency = {n: runnable(n, assignments[n].get("efficiency", [])) for n in numbers}
    cases = run_tests(list(dict.fromkeys(s for n in numbers for s in correctness[n] + efficiency[n])), pytest_args)

    def mine(spec):
        return [c for nodeid, c in cases.items() if matches(nodeid, spec)]

    def row(spec):
        failed = [c for c in mine(spec) if c["outcome"] != "passed"]
        return dict(test=spec, passed=len(mine(spec)) - len(failed), cases=len(mine(spec)),
                    message=f"{failed[0]['outcome']}: {failed[0]['message']}" if failed else "")
    results = []
    for n in numbers:
        a = assignments[n]
        rows = [dict(row(spec), private=spec not in a["tests"]) for spec in correctness[n]]
        later = [dict(test=spec, waits_for=m) for spec, m in wait[n].items()]
        eff_rows = [dict(row(spec), measured=any(c["measures"] for c in mine(spec))) for spec in efficiency[n]]
        eff_later = [r for r in later if r["test"] in a.get("efficiency", [])]
        measures = worst([c["measures"] for spec in efficiency[n] for c in mine(spec)])
        eff = dict(tests=eff_rows, later=eff_later, measures=measures,
                   summary=describe_efficiency(measures, eff_later, [r["message"] for r in eff_rows]))
        correct = all(r["passed"] == r["cases"] for r in rows)
        missing = [p for p in a.get("private", []) if p not in correctness[n] + list(wait[n])]
        results.append(dict(assignment=n, title=a["title"], tests=rows, later=[r for r in later if r not in eff_later],
                            efficiency=eff, correct=correct, passed=correct, missing_private=missing))
    return results


def worst(measures: list[dict]) -> dict:
    """The measures of several cases (host reads in each decoding mode, ...) merged: the largest of each
    number, and with the largest host reads the mode that read them ("mode", when a case recorded one)."""
    out = {}
    for m in measures:
        for key, value in m.items():
            if isinstance(value, (int, float)) and value >= out.get(key, value):
                out[key] = value
                if key == "host_reads_per_step" and "mode" in m:
                    out["host_reads_mode"] = m["mode"]
    return out


def describe_efficiency(m: dict, later=(), messages=()) -> str:
    """One line: ops and host reads per step (measures m) against the reference's and the bounds, or
    why there are none: the tests wait for a later assignment (later: rows of waits_for), or failed
    before measuring (messages)."""
    parts = []
    if "ops_per_step" in m:
        over = ": over" if m["ops_ratio"] > m["ops_ratio_bound"] else ""
        parts.append(f"{m['ops_per_step']:.1f} ops per step against the reference's {m['reference_ops_per_step']:.1f}, "
                     f"{m['ops_ratio']:.2f}x a plain token (bound {m['ops_ratio_bound']:.2f}{over})")
    if "host_reads_per_step" in m:
        reads, bound = m["host_reads_per_step"], m["host_reads_bound"]
        mode = f" with {m['host_reads_mode']}" if "host_reads_mode" in m else ""
        parts.append(f"{reads:.2f} host read{'' if reads == 1 else 's'} per step{mode} "
                     f"(bound {bound:g}{': over' if reads > bound else ''})")
    if parts:
        return "; ".join(parts)
    if later:
        return f"not measured yet: its tests need assignment {later[0]['waits_for']}, still stubbed here (LATER)"
    failed = [message for message in messages if message]
    return f"not measured: {failed[0]}" if failed else "no efficiency tests for this assignment"


def hint(assignments: dict, name: str) -> str:
    """The full hint for a function (`keep`, `KVCache.keep` or `medusa_mini.py:KVCache.keep`) of this copy."""
    found = []
    for n, a in assignments.items():
        for key in a["stubs"]:
            file, _, function = key.partition(":")
            if name in (key, function, function.rpartition(".")[2]):
                found.append((n, key, a.get("hints", {}).get(key)))
    if not found:
        names = [k.partition(":")[2] for a in assignments.values() for k in a.get("hints", {})]
        raise UsageError(f"no function {name!r} in {MAPPING}; hints exist for: {', '.join(names) or 'none'}")
    if len({key for _, key, _ in found}) > 1:
        raise UsageError(f"{name!r} could be {' or '.join(key for _, key, _ in found)}: give Class.method or file:name")
    n, key, text = found[0]
    if text is None:
        raise UsageError(f"no hint for {key} in this copy: it belongs to assignment {n}, which comes later")
    return f"Assignment {n}, {key}\n\n{text.strip()}\n"


# ----------------------------------------------------------------------------------------------
# The mutation check (instructors): known bugs planted in the reference code, one at a time

def load_mutants(assignments: dict, path=os.path.join(ROOT, MUTANTS), check=True) -> dict:
    """mutants.toml, checked: each fault names a function of its assignment, and (check: `assignments`
    with their tests) correctness tests that grade it in sequence; never an efficiency test (a fault is
    caught by what the code does, not by what it costs). A rewrite that names no tests gets those of the
    faults planted in its function (a slower one: every correctness test of its assignment, in sequence)."""
    if not os.path.exists(path):
        raise UsageError(f"no {MUTANTS} here: the mutation check runs in the full project, not in a student version")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{MUTANTS}: {e}") from None
    for kind in ("mutant", "equivalent"):
        for m in data.get(kind, []):
            missing = [k for k in ("assignment", "name", "function") if k not in m]
            missing += [] if "body" in m or ("replace" in m and "with" in m) else ["replace and with, or body"]
            if missing:
                raise UsageError(f"{MUTANTS}: a [[{kind}]] entry ({m.get('name', 'unnamed')}) lacks {', '.join(missing)}")
            n = m["assignment"]
            if n not in assignments:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} is for assignment {n!r}, which does not exist")
            if m["function"] not in assignments[n]["stubs"]:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r}: {m['function']} is not a function of assignment {n}")
            if m.get("slower") and (kind != "equivalent" or not assignments[n].get("efficiency", check is False)):
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r}: only an equivalent of an assignment with "
                                 "efficiency tests can be slower")
            if not check:
                continue
            allowed = graded_in_sequence(assignments, n)
            if "tests" not in m:  # the tests of the faults planted in its function; a slower rewrite: all
                same = [t for f in data.get("mutant", []) if f["function"] == m["function"] for t in f.get("tests", [])]
                m["tests"] = allowed if m.get("slower") else list(dict.fromkeys(same)) or allowed
            efficiency = [t for t in m["tests"] if is_efficiency_test(assignments, t)]
            if efficiency:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} runs {efficiency[0]}, an efficiency test: "
                                 "a fault must be caught by a correctness test")
            stray = [t for t in m["tests"] if not any(matches(t, spec) for spec in allowed)]
            if stray:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} runs {stray[0]}, which does not grade "
                                 f"assignment {n} in a copy handed out in sequence")
    return data


class MutantError(Exception):
    """A planted fault that no longer fits the code: its snippet or function has changed."""


def snippet_pattern(snippet: str) -> str:
    """A regular expression for a code snippet that does not care how the code is spaced or wrapped: its
    tokens in order, with any whitespace between them (some, between two words)."""
    tokens = re.findall(r"\w+|\S", snippet)
    pattern = re.escape(tokens[0]) if tokens else ""
    for before, token in zip(tokens, tokens[1:]):
        words = re.match(r"\w", before[-1]) and re.match(r"\w", token[0])
        pattern += (r"\s+" if words else r"\s*") + re.escape(token)
    return pattern


def planted_source(source: str, fault: dict) -> str:
    """`source` with one function rewritten: its `replace` snippet (found exactly once in the function,
    however it is spaced or wrapped) replaced by `with`, or its body after the docstring replaced by
    `body`. A MutantError, saying what to update, when it no longer fits the code."""
    file, _, name = fault["function"].partition(":")
    try:
        node = find_function(ast.parse(source), name)
    except LookupError as e:
        raise MutantError(f"{fault['name']!r} no longer applies: {e} in {file}: update or remove it in {MUTANTS}") \
            from None
    lines = source.splitlines(keepends=True)
    start = node.lineno - 1
    text = "".join(lines[start:node.end_lineno])  # from `def`, without decorators
    if "replace" in fault:
        found = list(re.finditer(snippet_pattern(fault["replace"]), text))
        if len(found) != 1:
            raise MutantError(f"{fault['name']!r} no longer applies: snippet {fault['replace']!r} "
                              f"{'not found' if not found else f'found {len(found)} times'} in {name} "
                              f"({file}, lines {node.lineno}-{node.end_lineno}): give it a snippet of the code as "
                              f"it is now in {MUTANTS}")
        text = text[:found[0].start()] + fault["with"] + text[found[0].end():]
        return "".join(lines[:start]) + text + "".join(lines[node.end_lineno:])
    indent = body_range(source, name)[2]
    return replace_body(source, name, [textwrap.indent(textwrap.dedent(fault["body"]), indent)])


def project_modules(root=ROOT) -> list:
    """The modules imported from the project's own files (the core, the lab, the tests), not the kit's."""
    root, kit = os.path.abspath(root) + os.sep, KIT + os.sep
    found = []
    for module in list(sys.modules.values()):
        path = os.path.abspath(getattr(module, "__file__", None) or os.sep)
        if path.startswith(root) and not path.startswith(kit):
            found.append(module)
    return found


def clear_caches(keys, root=ROOT):
    """Empty the project's functools caches (module-level ones, and those a module-level function keeps
    in its closure, as conftest.trained_once does) of what a fault in the functions `keys` changes: a
    model trained, or buffers built, with the fault must be made again. A cache that remembers what each
    entry reached (kit/reach.py, instrument) loses those entries only; any other cache, all of them."""
    for module in project_modules(root):
        for value in list(vars(module).values()):
            cells = [value] + [c.cell_contents for c in (getattr(value, "__closure__", None) or ())
                               if c.cell_contents is not value] if callable(value) else []
            for found in cells:
                if callable(getattr(found, "forget_reaching", None)):
                    found.forget_reaching(keys)
                elif callable(getattr(found, "cache_clear", None)):
                    found.cache_clear()


@contextlib.contextmanager
def planted(fault: dict, root=ROOT):
    """The fault written into its function for the duration of the block, in this process only: the
    function's code object is swapped for one compiled from the planted source (so every reference to it,
    imported by name anywhere, runs the fault), and swapped back after. Nothing is written to a file."""
    import importlib
    import inspect
    file, _, name = fault["function"].partition(":")
    path = os.path.join(root, file)
    with open(path, encoding="utf-8") as f:
        source = planted_source(f.read(), fault)
    owner, *parts, last = [importlib.import_module(file[:-3]), *name.split(".")]
    for part in parts:
        owner = getattr(owner, part)
    live = reach.running(fault["function"], inspect.unwrap(inspect.getattr_static(owner, last)))
    node = find_function(ast.parse(source), name)
    node.decorator_list = []
    tree = ast.Module([ast.ClassDef(parts[-1], [], [], [node], [])] if parts else [node], [])  # super() in a method
    code = compile(ast.fix_missing_locations(tree), path, "exec")
    while code.co_name != last:  # the module's code -> (the class body's) -> the function's
        code = next(c for c in code.co_consts if isinstance(c, type(code)) and c.co_name in (last, *parts))
    if code.co_freevars != live.__code__.co_freevars:
        raise MutantError(f"{fault['name']!r} cannot be planted: it changes the variables {name} closes over")
    original, live.__code__ = live.__code__, code
    try:
        yield
    finally:
        live.__code__ = original


def planter(faults, rows, assignments):
    """A pytest plugin that runs, in one session, each fault's tests with the fault planted (planted):
    a mutant's until the first fails, an equivalent's all (a slower one's efficiency tests too). Between
    faults and between tests every fixture is torn down, and between faults the project's caches are
    emptied, so nothing computed with one fault serves another. Appends one row per fault to `rows`."""
    import pytest

    class Planter:
        def __init__(self):
            self.items, self.reports = [], {}

        def pytest_collection_finish(self, session):
            self.items = list(session.items)

        def pytest_runtest_logreport(self, report):
            case = self.reports.setdefault(report.nodeid, {"outcome": "passed", "message": "", "measures": {}})
            case["measures"].update(report.user_properties)
            if case["outcome"] == "passed" and (report.failed or report.skipped):
                case.update(outcome="failed" if report.failed and report.when == "call" else
                            "error" if report.failed else "skipped", message=_message(report.longreprtext))

        def run(self, specs, stop_at_failure):
            self.reports = {}
            items = sorted((i for i in self.items if any(matches(i.nodeid, s) for s in specs)),
                           key=lambda i: next(k for k, s in enumerate(specs) if matches(i.nodeid, s)))
            for item in items:
                item.config.hook.pytest_runtest_protocol(item=item, nextitem=None)  # None: every fixture torn down
                if stop_at_failure and self.reports[item.nodeid]["outcome"] != "passed":
                    break
            for spec in specs:
                if not any(matches(i.nodeid, spec) for i in items):
                    self.reports[spec] = {"outcome": "error", "message": "not run: no such test", "measures": {}}
            return dict(self.reports)

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtestloop(self, session):
            for kind, fault in faults:
                row = dict(kind=kind, assignment=fault["assignment"], name=fault["name"], function=fault["function"])
                start = time.perf_counter()
                try:
                    with planted(fault):
                        clear_caches([fault["function"]])
                        cases = self.run(fault["tests"], kind == "mutant")
                        spent = self.run(assignments[fault["assignment"]]["efficiency"], False) \
                            if fault.get("slower") else {}
                except MutantError as e:
                    row.update(ok=False, stale=True, by="", message=f"mutant {e}")
                else:
                    judge(row, kind, fault, cases, spent)
                finally:
                    clear_caches([fault["function"]])
                row["seconds"] = round(time.perf_counter() - start, 2)
                rows.append(row)
            return True
    return Planter()


def judge(row, kind, fault, cases, spent):
    """A fault's row: a mutant is caught when a test failed; an equivalent passes when none did, and a
    slower one must also be measured costlier than the reference."""
    failed = [(nodeid, c) for nodeid, c in cases.items() if c["outcome"] != "passed"]
    by, message = (failed[0][0], failed[0][1]["message"]) if failed else ("", "")
    row.update(ok=bool(failed) == (kind == "mutant"), by=by, message=message, cases=len(cases))
    if fault.get("slower"):
        measures = worst([c["measures"] for c in spent.values()])
        more = measures.get("ops_per_step", -math.inf) > measures.get("reference_ops_per_step", math.inf)
        summary = describe_efficiency(measures, messages=[c["message"] for c in spent.values()])
        row["efficiency"] = dict(measures=measures, summary=summary)
        if row["ok"] and not more:
            row.update(ok=False, message=f"not slower than the reference: {row['efficiency']['summary']}")


def check_mutants(assignments: dict, data: dict, numbers) -> list[dict]:
    """Each fault: its tests with it planted, stopping at the first failure. Each equivalent (a correct
    rewrite): its tests must all pass, so a check that fails everything cannot pass for one that works.
    A slower equivalent must also cost more ops per step than the reference, measured by the assignment's
    efficiency tests: it is correct, and reported slower, never failed for it. One pytest session runs
    them all (planter), in this process; the project's files are not touched."""
    faults = [(kind, f) for kind in ("mutant", "equivalent") for f in data.get(kind, []) if f["assignment"] in numbers]
    # Caches that know what their entries reached, where this process has not imported the project yet:
    # a fault then retrains only what it changes.
    reach.instrument(ROOT, [key for a in assignments.values() for key in a["stubs"]])
    specs = list(dict.fromkeys(s for _, f in faults for s in f["tests"] + (
        assignments[f["assignment"]]["efficiency"] if f.get("slower") else [])))
    rows = []
    run_tests(specs, plugins=[planter(faults, rows, assignments)])
    return rows

