"""Grade a course assignment: run exactly its tests and print a score per test.

    python grade.py                 # every assignment in assignments.toml: a student version has one
    python grade.py 2               # assignment 2 only (in the full project every assignment passes)
    python grade.py --tb short      # also show pytest's tracebacks of the failures
    python grade.py --json out.json # the results, for an autograder

Which tests grade which assignment is written in assignments.toml. Private tests (files in
tests/private/, listed under `private`) are graded when present and announced when not.
Exit status 0 only when every graded test passes. See the README, "For instructors".
"""
import argparse
import json
import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.abspath(__file__))


def matches(nodeid: str, spec: str) -> bool:
    """Does a collected test belong to a spec: a node id, a test name (all its cases), or a file?"""
    return nodeid == spec or nodeid.startswith(spec + "[") or nodeid.startswith(spec + "::")


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

    def __init__(self, specs):
        self.specs = specs
        self.cases = {}           # nodeid -> {"outcome", "message"}
        self.collect_errors = {}  # file -> message

    def pytest_collection_modifyitems(self, config, items):
        wanted = [any(matches(item.nodeid, s) for s in self.specs) for item in items]
        config.hook.pytest_deselected(items=[item for item, w in zip(items, wanted) if not w])
        items[:] = [item for item, w in zip(items, wanted) if w]

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


def run_tests(specs, pytest_args=("--tb=no",)) -> dict[str, dict]:
    """Run the tests matching `specs` (node ids, test names or files) in this process.

    Returns {nodeid: {"outcome": passed/failed/error/skipped, "message": one line}}. A spec whose
    file does not import, or that matches nothing, gets one entry under its own name, "not run: why"."""
    import pytest
    os.chdir(ROOT)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    files = sorted({s.split("::")[0] for s in specs if os.path.exists(s.split("::")[0])})
    recorder = _Recorder(specs)
    if files:  # pytest with no paths would run the whole suite
        # Options of our own, not pytest.ini's addopts: grading must not depend on them (e.g. --nbmake).
        pytest.main(["-o", "addopts=", "-q", "-rN", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                     *pytest_args, *files], plugins=[recorder])
    cases = dict(recorder.cases)
    for spec in specs:
        if not any(matches(nodeid, spec) for nodeid in cases):
            file = spec.split("::")[0]
            why = (f"{file} does not import: {recorder.collect_errors[file]}" if file in recorder.collect_errors
                   else "no such test" if os.path.exists(file) else "no such file")
            cases[spec] = {"outcome": "error", "message": f"not run: {why}"}
    return cases


def _specs(assignment: dict) -> tuple[list[str], list[str]]:
    """(tests to run, private tests listed but not in this copy)."""
    private = assignment.get("private", [])
    present = [p for p in private if os.path.exists(os.path.join(ROOT, p.split("::")[0]))]
    return assignment["tests"] + present, [p for p in private if p not in present]


def grade(assignments: dict, pytest_args=("--tb=no",)) -> list[dict]:
    """Run the tests of the given assignments ({number: entry}) once; per assignment, one row per test."""
    specs = {n: _specs(a)[0] for n, a in assignments.items()}
    cases = run_tests(list(dict.fromkeys(s for n in specs for s in specs[n])), pytest_args)
    results = []
    for n, a in assignments.items():
        rows = []
        for spec in specs[n]:
            mine = [c for nodeid, c in cases.items() if matches(nodeid, spec)]
            failed = [c for c in mine if c["outcome"] != "passed"]
            rows.append(dict(test=spec, private=spec not in a["tests"], passed=len(mine) - len(failed), cases=len(mine),
                             message=f"{failed[0]['outcome']}: {failed[0]['message']}" if failed else ""))
        results.append(dict(assignment=n, title=a["title"], tests=rows, missing_private=_specs(a)[1],
                            passed=all(r["passed"] == r["cases"] for r in rows)))
    return results


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def print_report(result: dict):
    print(f"\nAssignment {result['assignment']}: {result['title']}")
    for r in result["tests"]:
        status = "PASS" if r["passed"] == r["cases"] else "FAIL"
        print(f"  {status}  {r['passed']:>2}/{r['cases']:<2}  {r['test']}" + ("  (private)" if r["private"] else ""))
        if r["message"]:
            print(f"               {_shorten(r['message'], 100)}")
    if result["missing_private"]:
        print(f"  ({len(result['missing_private'])} private test(s) are not in this copy: your instructor runs them)")
    n_pass = sum(r["passed"] == r["cases"] for r in result["tests"])
    cases_pass, cases = sum(r["passed"] for r in result["tests"]), sum(r["cases"] for r in result["tests"])
    print(f"Score: {n_pass}/{len(result['tests'])} tests pass ({cases_pass}/{cases} cases)"
          + ("" if result["passed"] else ": not done yet"))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Run exactly the tests of an assignment and print a score per test.")
    parser.add_argument("numbers", nargs="*", metavar="N",
                        help="assignments to grade (default: every one in assignments.toml; a student version has one)")
    parser.add_argument("--tb", default="no", choices=["no", "line", "short", "long"],
                        help="pytest traceback style for failures (default: no, the table gives one line each)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = parser.parse_args(argv)
    json_path = os.path.abspath(args.json) if args.json else None  # before run_tests changes directory
    with open(os.path.join(ROOT, "assignments.toml"), "rb") as f:
        assignments = tomllib.load(f)["assignment"]
    unknown = [n for n in args.numbers if n not in assignments]
    if unknown:
        parser.error(f"no assignment {', '.join(unknown)}: choose from {', '.join(assignments)}")
    results = grade({n: assignments[n] for n in args.numbers or assignments}, [f"--tb={args.tb}"])
    for result in results:
        print_report(result)
    passed = all(r["passed"] for r in results)
    if len(results) > 1:
        print(f"\n{sum(r['passed'] for r in results)}/{len(results)} assignments pass")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(passed=passed, assignments=results), f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
