"""Grade a course assignment: run exactly its tests and print a score per test.

    python kit/grade.py                    # this copy's assignment (the full project: every assignment)
    python kit/grade.py 2                  # assignment 2 only (in the full project every assignment passes)
    python kit/grade.py --hint keep        # the full hint for a function of this copy's assignment
    python kit/grade.py --json out.json    # the results, for an autograder
    python kit/grade.py --mutants          # instructors: plant known bugs, check that the tests catch each one

Which tests grade which assignment: in a copy, its kit/assignments.toml lists them; in the project, the
kit learns it by running the graded files once (kit/reach.py, cached in out/kit/). Correctness and efficiency are
graded apart: an assignment passes ("correct: yes", exit status 0) when every correctness test
passes; its efficiency tests (ops and host reads per step) are run and reported on their own line,
against the reference's figures and the bounds, and never fail it. Private tests (files in
tests/private/, listed under `private`) are graded when present and announced when not. A test that
also grades a later assignment whose functions are still stubs in this copy waits for that
assignment ("LATER"): it cannot pass before them. A mistake on the command line prints one line,
`error: ...`, and exits with 2. A failure's traceback: `python -m pytest "TEST"`.
See docs/instructors.md.
"""
import argparse
import importlib.util
import os
import sys
import textwrap
import tomllib

from grading import (MAPPING, MUTANTS, RunError, UsageError, check_mutants, check_writable, grade, hint,  # noqa: E402
                     load_assignments, load_mapping, load_mutants, write_json)

def print_row(status: str, r: dict, note: str = ""):
    print(f"  {status}  {r['passed']:>2}/{r['cases']:<2}  {r['test']}{note}")
    if r["message"]:
        print(textwrap.fill(r["message"], 110, initial_indent=" " * 13, subsequent_indent=" " * 15,
                            break_long_words=False, break_on_hyphens=False))


def print_later(rows: list[dict]):
    for r in rows:
        print(f"  LATER         {r['test']}  (needs assignment {r['waits_for']}, still stubbed here)")


def print_report(result: dict):
    print(f"\nAssignment {result['assignment']}: {result['title']}")
    for r in result["tests"]:
        print_row("PASS" if r["passed"] == r["cases"] else "FAIL", r, "  (private)" if r["private"] else "")
    print_later(result["later"])
    if result["missing_private"]:
        print(f"  ({len(result['missing_private'])} private test(s) are not in this copy: your instructor runs them)")
    eff = result["efficiency"]
    if eff["tests"] or eff["later"]:
        print("  Efficiency, reported apart (OVER: measured past its bound; never fails the assignment):")
        for r in eff["tests"]:
            print_row("PASS" if r["passed"] == r["cases"] else "OVER" if r["measured"] else "FAIL", r)
        print_later(eff["later"])
    n_pass = sum(r["passed"] == r["cases"] for r in result["tests"])
    cases_pass, cases = sum(r["passed"] for r in result["tests"]), sum(r["cases"] for r in result["tests"])
    print(f"correct: {'yes' if result['correct'] else 'no'} ({n_pass}/{len(result['tests'])} tests pass, "
          f"{cases_pass}/{cases} cases)")
    print(f"efficiency: {eff['summary']}")
    if result["later"]:
        print(f"{len(result['later'])} more test(s) grade this assignment end to end once the later ones are done.")


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
            if "efficiency" in r:  # a slower rewrite: correct, and what its step costs
                print(textwrap.fill(f"efficiency: {r['efficiency']['summary']}", 110, initial_indent=" " * 10,
                                    subsequent_indent=" " * 12, break_long_words=False, break_on_hyphens=False))
    caught = [r for r in rows if r["kind"] == "mutant"]
    equivalents = [r for r in rows if r["kind"] == "equivalent"]
    print(f"\n{sum(r['ok'] for r in caught)}/{len(caught)} planted faults caught by correctness tests; "
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
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    parser.add_argument("--hint", metavar="NAME", help="print the full hint for a function of this assignment and exit")
    parser.add_argument("--mutants", action="store_true",
                        help=f"instructors: plant each fault of {MUTANTS} in the reference code and check that "
                             "the assignment's correctness tests catch it")
    try:
        args = parser.parse_args(argv)
        json_path = os.path.abspath(args.json) if args.json is not None else None  # before run_tests changes directory
        if json_path is not None and (not args.json.strip() or os.path.isdir(json_path)):
            raise UsageError(f"--json {args.json!r}: give a file to write, not a folder")
        if json_path and not os.path.isdir(os.path.dirname(json_path)):
            raise UsageError(f"--json {args.json}: no directory {os.path.dirname(json_path)}")
        if json_path:
            check_writable(os.path.dirname(json_path))  # before grading, not after
        if args.hint is not None and not args.hint.strip():
            raise UsageError("--hint: give a function's name, e.g. --hint evaluate_posterior")
        if importlib.util.find_spec("torch") is None:
            raise UsageError(f"torch is not installed for this Python ({sys.executable}): the tests need it "
                             f"(pip install torch==2.13.0 on a CPU-only machine, then pip install -r requirements.txt)")
        try:
            mapping = load_mapping()
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"cannot read {MAPPING}: {e}") from None
        if args.hint is not None:
            print(hint(mapping["assignment"], args.hint), end="")
            return 0
        assignments = mapping["assignment"]
        unknown = [n for n in args.numbers if n not in assignments]
        if unknown:
            raise UsageError(f"no assignment {', '.join(unknown)} in {MAPPING}: choose from {', '.join(assignments)}")
        default = [str(mapping["default"])] if "default" in mapping else list(assignments)
        numbers = args.numbers or (list(assignments) if args.mutants else default)
        assignments = load_assignments(mapping, note=lambda line: print(line, file=sys.stderr))
        data = load_mutants(assignments) if args.mutants else None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.mutants:
        rows = check_mutants(assignments, data, numbers)
        print_mutants(rows, assignments)
        passed, out = all(r["ok"] for r in rows), dict(mutants=rows)
    else:
        results = grade(assignments, numbers)
        for result in results:
            print_report(result)
        passed, out = all(r["passed"] for r in results), dict(assignments=results)
        if len(results) > 1:
            print(f"\n{sum(r['passed'] for r in results)}/{len(results)} assignments pass")
    if json_path:
        try:
            write_json(json_path, dict(passed=passed, **out), indent=1)
        except RunError as e:  # the disk filled while grading: the scores above stand
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
