"""The assignment kit's machinery: functions found by name (make_assignment.py stubs them), which
tests grade an assignment and which wait for a later one, running them in this process, and the
mutation check that plants known bugs. The commands grade.py and make_assignment.py use it; see
docs/instructors.md.

An assignment is graded for correctness (its `tests`: it passes when they all pass) and, apart,
for efficiency (its `efficiency` tests: what a step costs, measured and reported, never failed).
"""
import ast
import contextlib
import importlib
import inspect
import io
import math
import os
import re
import sys
import textwrap
import time
import tomllib
from unittest import mock

ROOT = os.path.dirname(os.path.abspath(__file__))
MAPPING = "assignments.toml"
MUTANTS = "mutants.toml"  # instructors only: never copied into a student version


class UsageError(Exception):
    """A mistake of the person running a command: printed as one line, `error: ...`."""


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
    """Is the body of `name`, after its docstring, a single `raise NotImplementedError(...)`?"""
    func = find_function(ast.parse(source), name)
    body = func.body[1:] if _has_docstring(func) else func.body
    exc = body[0].exc if len(body) == 1 and isinstance(body[0], ast.Raise) else None
    return getattr(getattr(exc, "func", exc), "id", None) == "NotImplementedError"


def stubbed_here(assignment: dict, root=ROOT) -> bool:
    """Is any function of this assignment still a stub in the copy at `root`?"""
    for key in assignment["stubs"]:
        file, _, name = key.partition(":")
        try:
            with open(os.path.join(root, file), encoding="utf-8") as f:
                if is_stub(f.read(), name):
                    return True
        except (OSError, LookupError, SyntaxError):
            continue  # a missing or broken function fails its tests anyway
    return False


def require(numbers, command: str, root=ROOT):
    """For a command run in a student copy: a ValueError naming the first of these assignments (None:
    all of them) whose functions are still stubs here, so that the command stops with one line before
    doing anything. In the full project (no stubs) it costs a parse of the stubbed files."""
    try:
        assignments = load_mapping(os.path.join(root, MAPPING))["assignment"]
    except (OSError, tomllib.TOMLDecodeError):
        return
    for n, a in assignments.items():
        if numbers is not None and n not in numbers:
            continue
        if stubbed_here(a, root):
            raise ValueError(f"{command} needs assignment {n} ({a['title']}), still stubs in this copy: "
                             f"write it, and check it with `python grade.py {n}`")


# ----------------------------------------------------------------------------------------------
# The mapping: which tests grade an assignment now, and which wait for a later one

def load_mapping(path=os.path.join(ROOT, MAPPING)) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def matches(nodeid: str, spec: str) -> bool:
    """Does a collected test belong to a spec: a node id, a test name (all its cases), or a file?"""
    return nodeid == spec or nodeid.startswith(spec + "[") or nodeid.startswith(spec + "::")


def _specs(assignment: dict) -> list[str]:
    """Every test the assignment runs: correctness (public and private), then efficiency."""
    return assignment["tests"] + assignment.get("private", []) + assignment.get("efficiency", [])


def waiting(assignments: dict, n: str, later_stubbed=None) -> dict[str, str]:
    """{spec: m} for the tests of assignment n (correctness or efficiency) that also grade a later
    assignment m whose functions are stubs (default: those still stubs in this copy). They cannot
    pass before m is done."""
    order = list(assignments)
    if later_stubbed is None:
        later_stubbed = [m for m in order[order.index(n) + 1:] if stubbed_here(assignments[m])]
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

def _message(longrepr) -> str:
    """One line saying why: the exception line of a failure or collection error. A failed
    pytest.raises(match=...) also says what it expected and what it got (pytest puts those on the
    lines after "Regex pattern did not match.")."""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        where = os.path.relpath(crash.path, ROOT) if os.path.isabs(crash.path) else crash.path
        first, *rest = crash.message.strip().splitlines() or [""]
        # older pytest writes " Regex: ..." and " Input: ...", pytest 9 "Expected regex:" and "Actual message:"
        regex = [line.strip() for line in rest
                 if re.match(r"\s*(Regex|Input|Expected regex|Actual message):", line)]
        return f"{where}:{crash.lineno}: {first}" + (f" {'; '.join(regex)}" if regex else "")
    lines = [line.strip() for line in str(longrepr).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[-1]


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
            self.collect_errors[report.nodeid] = _message(report.longrepr)

    def pytest_runtest_logreport(self, report):
        case = self.cases.setdefault(report.nodeid, {"outcome": "passed", "message": "", "measures": {}})
        case["measures"].update(report.user_properties)  # what an efficiency test recorded, pass or fail
        if case["outcome"] != "passed":
            return  # keep the first problem (a setup error, then the call is not run)
        if report.failed:
            case.update(outcome="failed" if report.when == "call" else "error", message=_message(report.longrepr))
        elif report.skipped:
            case.update(outcome="skipped", message=_message(report.longrepr))


def run_tests(specs, pytest_args=("--tb=no",), in_spec_order=False) -> dict[str, dict]:
    """Run the tests matching `specs` (node ids, test names or files) in this process.

    Returns {nodeid: {"outcome": passed/failed/error/skipped, "message": one line, "measures": what
    the test recorded with record_property}}. A spec whose file does not import, or that matches
    nothing, gets one entry under its own name, "not run: why".
    in_spec_order: run in the order of `specs` rather than the files' (to fail fast with -x)."""
    import pytest
    os.chdir(ROOT)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    files = sorted({s.split("::")[0] for s in specs if os.path.exists(s.split("::")[0])})
    recorder = _Recorder(specs, in_spec_order)
    if files:  # pytest with no paths would run the whole suite
        # Options of our own, not pytest.ini's addopts, and no plugin that happens to be installed: grading
        # must not depend on them (the graded tests use none), and loading them slows every run.
        with mock.patch.dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"):  # restored afterwards
            pytest.main(["-o", "addopts=", "-q", "-rN", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                         *pytest_args, *files], plugins=[recorder])
    cases = dict(recorder.cases)
    for spec in specs:
        if not any(matches(nodeid, spec) for nodeid in cases) and "-x" not in pytest_args:
            file = spec.split("::")[0]
            why = (f"{file} does not import: {recorder.collect_errors[file]}" if file in recorder.collect_errors
                   else "no such test" if os.path.exists(file) else "no such file")
            cases[spec] = {"outcome": "error", "message": f"not run: {why}", "measures": {}}
    return cases


# ----------------------------------------------------------------------------------------------
# Grading

def grade(assignments: dict, numbers, pytest_args=("--tb=no",)) -> list[dict]:
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
    """The measures of several cases (host reads in each decoding mode, ...) merged: the largest of each."""
    out = {}
    for m in measures:
        for key, value in m.items():
            out[key] = max(out.get(key, value), value)
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
        parts.append(f"{reads:.2f} host read{'' if reads == 1 else 's'} per step "
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

def load_mutants(assignments: dict, path=os.path.join(ROOT, MUTANTS)) -> dict:
    """mutants.toml, checked: each fault names a function of its assignment, and correctness tests that
    grade it in sequence; never an efficiency test (a fault is caught by what the code does, not by
    what it costs)."""
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
            allowed = graded_in_sequence(assignments, n)
            if "tests" not in m:  # the tests of the faults planted in its function; a slower rewrite: all
                same = [t for f in data.get("mutant", []) if f["function"] == m["function"] for t in f.get("tests", [])]
                m["tests"] = allowed if m.get("slower") else list(dict.fromkeys(same)) or allowed
            efficiency = [t for t in m["tests"] if is_efficiency_test(assignments, t)]
            if efficiency:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} runs {efficiency[0]}, an efficiency test: "
                                 "a fault must be caught by a correctness test")
            if m.get("slower") and (kind != "equivalent" or not assignments[n].get("efficiency")):
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r}: only an equivalent of an assignment with "
                                 "efficiency tests can be slower")
            stray = [t for t in m["tests"] if t not in allowed]
            if stray:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} runs {stray[0]}, which does not grade "
                                 f"assignment {n} in a copy handed out in sequence")
    return data


class MutantError(Exception):
    """A planted fault that no longer fits the code: its snippet or function has changed."""


@contextlib.contextmanager
def planted(fault: dict):
    """Run the code with one function rewritten: its `replace` snippet (exactly once in the function)
    replaced by `with`, or its body after the docstring replaced by `body`. The function object keeps
    its identity (its __code__ is swapped), so every `from module import name` sees the fault. A method
    whose rewrite no longer calls super() (its code lost the __class__ cell) is replaced on its class."""
    file, _, name = fault["function"].partition(":")
    with open(os.path.join(ROOT, file), encoding="utf-8") as f:
        source = f.read()
    try:
        node = find_function(ast.parse(source), name)
    except LookupError as e:
        raise MutantError(f"{fault['name']!r} no longer applies: {e} in {file}") from None
    lines = source.splitlines(keepends=True)
    text = "".join(lines[node.lineno - 1:node.end_lineno])  # from `def`, without decorators
    if "replace" in fault:
        count = text.count(fault["replace"])
        if count != 1:
            raise MutantError(f"{fault['name']!r} no longer applies: snippet {fault['replace']!r} "
                              f"{'not found' if count == 0 else f'found {count} times'} in {name}")
        text = text.replace(fault["replace"], fault["with"])
    text = textwrap.dedent(text)
    if "body" in fault:
        indent = body_range(text, name.rpartition(".")[2])[2]
        text = replace_body(text, name.rpartition(".")[2], [textwrap.indent(textwrap.dedent(fault["body"]), indent)])
    module = importlib.import_module(os.path.splitext(file)[0])
    *classes, short = name.split(".")
    if classes:  # compiled inside a class, so that super() finds its __class__ cell as in the original
        text = f"class {classes[-1]}:\n" + textwrap.indent(text, "    ")
    namespace = dict(vars(module))
    exec(compile("\n" * (node.lineno - 1 - bool(classes)) + text, os.path.join(ROOT, file), "exec"), namespace)
    owner = module
    for cls in classes:
        owner = getattr(owner, cls)
    new = vars(namespace[classes[-1]])[short] if classes else namespace[short]
    live = inspect.unwrap(vars(owner)[short])
    original, attribute = live.__code__, vars(owner)[short]
    swap = new.__code__.co_freevars == original.co_freevars
    if not swap and not classes:
        raise MutantError(f"{fault['name']!r}: the rewrite of {name} needs other closure variables")
    _clear_caches()
    if swap:
        live.__code__ = new.__code__
    else:
        setattr(owner, short, new)
    try:
        yield
    finally:
        if swap:
            live.__code__ = original
        else:
            setattr(owner, short, attribute)
        _clear_caches()


def _clear_caches():
    """Forget what the project's functools caches hold (tree buffers, ...): built by other code."""
    for module in list(sys.modules.values()):
        if os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == ROOT:
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


def check_mutants(assignments: dict, data: dict, numbers) -> list[dict]:
    """Each fault: run its tests with it planted, stopping at the first failure. Each equivalent (a
    correct rewrite): its tests must all pass, so a check that fails everything cannot pass for one
    that works. A slower equivalent must also cost more ops per step than the reference, measured by
    the assignment's efficiency tests: correct, and reported slower, never failed for it."""
    rows = []
    for kind in ("mutant", "equivalent"):
        for fault in data.get(kind, []):
            if fault["assignment"] not in numbers:
                continue
            row = dict(kind=kind, assignment=fault["assignment"], name=fault["name"], function=fault["function"])
            start = time.perf_counter()
            try:
                with planted(fault), contextlib.redirect_stdout(io.StringIO()):
                    # -p no:unraisableexception: its gc.collect() calls cost 1.5 s a run
                    cases = run_tests(fault["tests"], ("--tb=no", "-p", "no:unraisableexception")
                                      + (("-x",) if kind == "mutant" else ()), in_spec_order=True)
                    if fault.get("slower"):
                        spent = run_tests(assignments[fault["assignment"]]["efficiency"],
                                          ("--tb=no", "-p", "no:unraisableexception"))
            except MutantError as e:
                row.update(ok=False, stale=True, by="", message=f"mutant {e}")
            else:
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
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
    return rows


