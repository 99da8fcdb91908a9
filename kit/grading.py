"""The assignment kit's machinery: functions found by name (make_assignment.py stubs them), which
tests grade an assignment and which wait for a later one, running them in this process, and the
mutation check that plants known bugs. The commands kit/grade.py and kit/make_assignment.py use it;
see docs/instructors.md and kit/tests/README.md.

An assignment is graded for correctness (its `tests`: it passes when they all pass) and, apart,
for efficiency (its `efficiency` tests: what a step costs, measured and reported, never failed).
A stub is one line, `raise NotImplementedError("assignment N: name: nudge")` (lab/stubs.py reads it).
"""
import ast
import contextlib
import io
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

import stubs  # noqa: E402  (the kit reads a copy's stubs itself; the lab never uses the kit)
from lab.cli import UsageError  # noqa: E402  (a mistake of the person running a command: one line, exit 2)

MAPPING = "kit/assignments.toml"
MUTANTS = "kit/mutants.toml"  # instructors only: never copied into a student version


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


def run_tests(specs, pytest_args=(), in_spec_order=False, root=ROOT) -> dict[str, dict]:
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
                             "--continue-on-collection-errors", *pytest_args, *files], plugins=[recorder])
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
            stray = [t for t in m["tests"] if not any(matches(t, spec) for spec in allowed)]
            if stray:
                raise UsageError(f"{MUTANTS}: {kind} {m['name']!r} runs {stray[0]}, which does not grade "
                                 f"assignment {n} in a copy handed out in sequence")
    return data


class MutantError(Exception):
    """A planted fault that no longer fits the code: its snippet or function has changed."""


def planted_source(source: str, fault: dict) -> str:
    """`source` with one function rewritten: its `replace` snippet (exactly once in the function) replaced
    by `with`, or its body after the docstring replaced by `body`. A MutantError when it no longer fits."""
    file, _, name = fault["function"].partition(":")
    try:
        node = find_function(ast.parse(source), name)
    except LookupError as e:
        raise MutantError(f"{fault['name']!r} no longer applies: {e} in {file}") from None
    lines = source.splitlines(keepends=True)
    start = node.lineno - 1
    text = "".join(lines[start:node.end_lineno])  # from `def`, without decorators
    if "replace" in fault:
        count = text.count(fault["replace"])
        if count != 1:
            raise MutantError(f"{fault['name']!r} no longer applies: snippet {fault['replace']!r} "
                              f"{'not found' if count == 0 else f'found {count} times'} in {name}")
        return "".join(lines[:start]) + text.replace(fault["replace"], fault["with"]) + "".join(lines[node.end_lineno:])
    indent = body_range(source, name)[2]
    return replace_body(source, name, [textwrap.indent(textwrap.dedent(fault["body"]), indent)])


def workspace(root=ROOT) -> str:
    """A scratch copy of the project's code and tests (what the graded tests import), for planting faults."""
    scratch = tempfile.mkdtemp(prefix="medusa-mutants-")
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in {".git", "out", "__pycache__", ".pytest_cache", "notebooks", "docs"}]
        for name in files:
            if name.endswith((".py", ".toml", ".ini")):
                src = os.path.join(folder, name)
                dst = os.path.join(scratch, os.path.relpath(src, root))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)
    return scratch


def forget_modules(*roots):
    """Drop from sys.modules every module loaded from these folders, so that the next import reads the
    files as they are now (a planted fault, then the original)."""
    roots = [os.path.abspath(r) + os.sep for r in roots]
    for name, module in list(sys.modules.items()):
        path = os.path.abspath(getattr(module, "__file__", None) or os.sep)
        if name != "__main__" and not path.startswith(KIT + os.sep) and any(path.startswith(r) for r in roots):
            del sys.modules[name]


@contextlib.contextmanager
def planted(fault: dict, scratch: str):
    """The scratch copy with the fault written into its file for the duration of the block."""
    file = fault["function"].partition(":")[0]
    path = os.path.join(scratch, file)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(planted_source(original, fault))
    try:
        yield
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)


def run_planted(fault, specs, scratch, pytest_args=()):
    """run_tests on the scratch copy with `fault` planted, its modules imported afresh."""
    with planted(fault, scratch):
        forget_modules(scratch, ROOT)
        sys.path.insert(0, scratch)
        try:
            return run_tests(specs, pytest_args, in_spec_order=True, root=scratch)
        finally:
            sys.path.remove(scratch)
            forget_modules(scratch)


def check_mutants(assignments: dict, data: dict, numbers) -> list[dict]:
    """Each fault: its tests with it planted (in a scratch copy of the project), stopping at the first
    failure. Each equivalent (a correct rewrite): its tests must all pass, so a check that fails
    everything cannot pass for one that works. A slower equivalent must also cost more ops per step
    than the reference, measured by the assignment's efficiency tests: it is correct, and reported
    slower, never failed for it."""
    rows, scratch = [], workspace()
    try:
        for kind in ("mutant", "equivalent"):
            for fault in data.get(kind, []):
                if fault["assignment"] not in numbers:
                    continue
                rows.append(check_one(kind, fault, assignments, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def check_one(kind, fault, assignments, scratch) -> dict:
    row = dict(kind=kind, assignment=fault["assignment"], name=fault["name"], function=fault["function"])
    start = time.perf_counter()
    try:
        cases = run_planted(fault, fault["tests"], scratch, ("-x",) if kind == "mutant" else ())
        if fault.get("slower"):
            spent = run_planted(fault, assignments[fault["assignment"]]["efficiency"], scratch)
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
    return row
