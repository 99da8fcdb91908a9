"""Grade a course assignment: run exactly its tests and print a score per test.

    python grade.py                    # this copy's assignment (the full project: every assignment)
    python grade.py 2                  # assignment 2 only (in the full project every assignment passes)
    python grade.py --hint keep        # the full hint for a function of this copy's assignment
    python grade.py --tb short         # also show pytest's tracebacks of the failures
    python grade.py --json out.json    # the results, for an autograder
    python grade.py --mutants          # instructors: plant known bugs, check that the tests catch each one

Which tests grade which assignment is written in assignments.toml. Private tests (files in
tests/private/, listed under `private`) are graded when present and announced when not. A test that
also grades a later assignment whose functions are still stubs in this copy waits for that
assignment ("LATER"): it cannot pass before them. Exit status 0 only when every graded test passes;
a mistake on the command line prints one line, `error: ...`, and exits with 2.
See the README, "For instructors".
"""
import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import os
import sys
import textwrap
import time
import tomllib

ROOT = os.path.dirname(os.path.abspath(__file__))
MAPPING = "assignments.toml"
MUTANTS = "mutants.toml"  # instructors only: never copied into a student version


class UsageError(Exception):
    """A mistake of the person running the command: printed as one line, `error: ...`."""


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


# ----------------------------------------------------------------------------------------------
# The mapping: which tests grade an assignment now, and which wait for a later one

def load_mapping(path=os.path.join(ROOT, MAPPING)) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def matches(nodeid: str, spec: str) -> bool:
    """Does a collected test belong to a spec: a node id, a test name (all its cases), or a file?"""
    return nodeid == spec or nodeid.startswith(spec + "[") or nodeid.startswith(spec + "::")


def _specs(assignment: dict) -> list[str]:
    return assignment["tests"] + assignment.get("private", [])


def waiting(assignments: dict, n: str, later_stubbed=None) -> dict[str, str]:
    """{spec: m} for the tests of assignment n that also grade a later assignment m whose functions
    are stubs (default: those still stubs in this copy). They cannot pass before m is done."""
    order = list(assignments)
    if later_stubbed is None:
        later_stubbed = [m for m in order[order.index(n) + 1:] if stubbed_here(assignments[m])]
    out = {}
    for spec in _specs(assignments[n]):
        for m in later_stubbed:
            if any(matches(spec, t) or matches(t, spec) for t in _specs(assignments[m])):
                out.setdefault(spec, m)
    return out


def graded_in_sequence(assignments: dict, n: str) -> list[str]:
    """The tests of n that a student version handed out in sequence grades: every later assignment stubbed."""
    later = list(assignments)[list(assignments).index(n) + 1:]
    wait = waiting(assignments, n, later)
    return [t for t in assignments[n]["tests"] if t not in wait]


# ----------------------------------------------------------------------------------------------
# Running tests in this process

def _message(longrepr) -> str:
    """One line saying why: the exception line of a failure or collection error."""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        where = os.path.relpath(crash.path, ROOT) if os.path.isabs(crash.path) else crash.path
        return f"{where}:{crash.lineno}: " + (crash.message.strip().splitlines() or [""])[0]
    lines = [line.strip() for line in str(longrepr).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[-1]


class _Recorder:
    """pytest plugin: keeps only the tests matching the specs and records each one's outcome."""

    def __init__(self, specs, in_spec_order=False):
        self.specs = specs
        self.in_spec_order = in_spec_order
        self.cases = {}           # nodeid -> {"outcome", "message"}
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
        case = self.cases.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if case["outcome"] != "passed":
            return  # keep the first problem (a setup error, then the call is not run)
        if report.failed:
            case.update(outcome="failed" if report.when == "call" else "error", message=_message(report.longrepr))
        elif report.skipped:
            case.update(outcome="skipped", message=_message(report.longrepr))


def run_tests(specs, pytest_args=("--tb=no",), in_spec_order=False) -> dict[str, dict]:
    """Run the tests matching `specs` (node ids, test names or files) in this process.

    Returns {nodeid: {"outcome": passed/failed/error/skipped, "message": one line}}. A spec whose
    file does not import, or that matches nothing, gets one entry under its own name, "not run: why".
    in_spec_order: run in the order of `specs` rather than the files' (to fail fast with -x)."""
    import pytest
    os.chdir(ROOT)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    files = sorted({s.split("::")[0] for s in specs if os.path.exists(s.split("::")[0])})
    recorder = _Recorder(specs, in_spec_order)
    if files:  # pytest with no paths would run the whole suite
        # Options of our own, not pytest.ini's addopts: grading must not depend on them (e.g. --nbmake).
        pytest.main(["-o", "addopts=", "-q", "-rN", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                     *pytest_args, *files], plugins=[recorder])
    cases = dict(recorder.cases)
    for spec in specs:
        if not any(matches(nodeid, spec) for nodeid in cases) and "-x" not in pytest_args:
            file = spec.split("::")[0]
            why = (f"{file} does not import: {recorder.collect_errors[file]}" if file in recorder.collect_errors
                   else "no such test" if os.path.exists(file) else "no such file")
            cases[spec] = {"outcome": "error", "message": f"not run: {why}"}
    return cases


# ----------------------------------------------------------------------------------------------
# Grading

def grade(assignments: dict, numbers, pytest_args=("--tb=no",)) -> list[dict]:
    """Run the tests of the given assignments once; per assignment, one row per test."""
    wait = {n: waiting(assignments, n) for n in numbers}
    specs = {n: [s for s in _specs(assignments[n]) if s not in wait[n]] for n in numbers}
    present = {n: [s for s in specs[n] if os.path.exists(os.path.join(ROOT, s.split("::")[0]))] for n in numbers}
    cases = run_tests(list(dict.fromkeys(s for n in numbers for s in present[n])), pytest_args)
    results = []
    for n in numbers:
        a, rows = assignments[n], []
        for spec in present[n]:
            mine = [c for nodeid, c in cases.items() if matches(nodeid, spec)]
            failed = [c for c in mine if c["outcome"] != "passed"]
            rows.append(dict(test=spec, private=spec not in a["tests"], passed=len(mine) - len(failed), cases=len(mine),
                             message=f"{failed[0]['outcome']}: {failed[0]['message']}" if failed else ""))
        later = [dict(test=spec, waits_for=m) for spec, m in wait[n].items()]
        results.append(dict(assignment=n, title=a["title"], tests=rows, later=later,
                            missing_private=[p for p in a.get("private", []) if p not in present[n] + list(wait[n])],
                            passed=all(r["passed"] == r["cases"] for r in rows)))
    return results


def print_report(result: dict):
    print(f"\nAssignment {result['assignment']}: {result['title']}")
    for r in result["tests"]:
        status = "PASS" if r["passed"] == r["cases"] else "FAIL"
        print(f"  {status}  {r['passed']:>2}/{r['cases']:<2}  {r['test']}" + ("  (private)" if r["private"] else ""))
        if r["message"]:
            print(textwrap.fill(r["message"], 110, initial_indent=" " * 13, subsequent_indent=" " * 15,
                                break_long_words=False, break_on_hyphens=False))
    for r in result["later"]:
        print(f"  LATER         {r['test']}  (needs assignment {r['waits_for']}, still stubbed here)")
    if result["missing_private"]:
        print(f"  ({len(result['missing_private'])} private test(s) are not in this copy: your instructor runs them)")
    n_pass = sum(r["passed"] == r["cases"] for r in result["tests"])
    cases_pass, cases = sum(r["passed"] for r in result["tests"]), sum(r["cases"] for r in result["tests"])
    print(f"Score: {n_pass}/{len(result['tests'])} tests pass ({cases_pass}/{cases} cases)"
          + ("" if result["passed"] else ": not done yet"))
    if result["later"]:
        print(f"{len(result['later'])} more test(s) grade this assignment end to end once the later ones are done.")


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
    """mutants.toml, checked: each fault names a function of its assignment, and tests that grade it in sequence."""
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
            if "tests" not in m:  # an equivalent: the tests of the faults planted in its function
                same = [t for f in data.get("mutant", []) if f["function"] == m["function"] for t in f.get("tests", [])]
                m["tests"] = list(dict.fromkeys(same)) or allowed
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
    its identity (its __code__ is swapped), so every `from module import name` sees the fault."""
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
    original = live.__code__
    _clear_caches()
    live.__code__ = new.__code__
    try:
        yield
    finally:
        live.__code__ = original
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
    correct rewrite): its tests must all pass, so a check that fails everything cannot pass for one that works."""
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
            except MutantError as e:
                row.update(ok=False, stale=True, by="", message=f"mutant {e}")
            else:
                failed = [(nodeid, c) for nodeid, c in cases.items() if c["outcome"] != "passed"]
                by, message = (failed[0][0], failed[0][1]["message"]) if failed else ("", "")
                row.update(ok=bool(failed) == (kind == "mutant"), by=by, message=message, cases=len(cases))
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
    return rows


def print_mutants(rows: list[dict], assignments: dict):
    for n in dict.fromkeys(r["assignment"] for r in rows):
        print(f"\nAssignment {n}: {assignments[n]['title']}")
        for r in (r for r in rows if r["assignment"] == n):
            if r.get("stale"):
                status = "STALE "
            elif r["kind"] == "mutant":
                status = "caught" if r["ok"] else "MISSED"
            else:
                status = "passes" if r["ok"] else "FAILS "
            function = r["function"].partition(":")[2]
            print(f"  {status}  {function:<24} {r['name']}")
            if r["by"]:
                print(f"{'':10}{'by' if r['kind'] == 'mutant' else 'fails'} {r['by'].split('::')[-1]}")
            if r["message"] and (r["kind"] == "mutant" or not r["ok"]):
                message = r["message"] if r.get("stale") else r["message"].split(": ", 1)[-1]  # no file:line
                print(textwrap.fill(message, 110, initial_indent=" " * 10,
                                    subsequent_indent=" " * 10, break_long_words=False, break_on_hyphens=False))
    caught = [r for r in rows if r["kind"] == "mutant"]
    equivalents = [r for r in rows if r["kind"] == "equivalent"]
    print(f"\n{sum(r['ok'] for r in caught)}/{len(caught)} planted faults caught; "
          f"{sum(r['ok'] for r in equivalents)}/{len(equivalents)} correct rewrites pass "
          f"({sum(r['seconds'] for r in rows):.0f} s)")


# ----------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def main(argv=None):
    parser = _Parser(description="Run exactly the tests of an assignment and print a score per test.")
    parser.add_argument("numbers", nargs="*", metavar="N",
                        help="assignments to grade (default: this copy's assignment; in the full project, all)")
    parser.add_argument("--tb", default="no", choices=["no", "line", "short", "long"],
                        help="pytest traceback style for failures (default: no, the table gives one line each)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    parser.add_argument("--hint", metavar="NAME", help="print the full hint for a function of this assignment and exit")
    parser.add_argument("--mutants", action="store_true",
                        help=f"instructors: plant each fault of {MUTANTS} in the reference code and check that "
                             "the assignment's tests catch it")
    try:
        args = parser.parse_args(argv)
        json_path = os.path.abspath(args.json) if args.json else None  # before run_tests changes directory
        if json_path and not os.path.isdir(os.path.dirname(json_path)):
            raise UsageError(f"--json {args.json}: no directory {os.path.dirname(json_path)}")
        try:
            mapping = load_mapping()
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"cannot read {MAPPING}: {e}") from None
        assignments = mapping["assignment"]
        if args.hint:
            print(hint(assignments, args.hint), end="")
            return 0
        unknown = [n for n in args.numbers if n not in assignments]
        if unknown:
            raise UsageError(f"no assignment {', '.join(unknown)} in {MAPPING}: choose from {', '.join(assignments)}")
        default = [str(mapping["default"])] if "default" in mapping else list(assignments)
        numbers = args.numbers or (list(assignments) if args.mutants else default)
        data = load_mutants(assignments) if args.mutants else None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.mutants:
        rows = check_mutants(assignments, data, numbers)
        print_mutants(rows, assignments)
        passed, out = all(r["ok"] for r in rows), dict(mutants=rows)
    else:
        results = grade(assignments, numbers, [f"--tb={args.tb}"])
        for result in results:
            print_report(result)
        passed, out = all(r["passed"] for r in results), dict(assignments=results)
        if len(results) > 1:
            print(f"\n{sum(r['passed'] for r in results)}/{len(results)} assignments pass")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(passed=passed, **out), f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
