"""Write a student version of medusa-mini for one course assignment.

    python kit/make_assignment.py --list                       # the assignments, what they stub, what grades them
    python kit/make_assignment.py 2 --out out/assignment-2     # the whole project, assignment 2 stubbed

kit/assignments.toml says, for each assignment, which functions become stubs (with a short nudge, and a
full hint that `python kit/grade.py --hint NAME` prints); which tests grade it, the kit learns by running
the graded files (kit/reach.py) and writes into the copy's own assignments.toml. Assignments are handed
out in the order of that file: the copy for N also stubs every later assignment's functions (no hint),
so it holds no solution the student has not written yet, and grade.py grades N on the tests that do not
need them. A stub keeps its decorators, signature and docstring; its body becomes one line,
`raise NotImplementedError("assignment N: <function>: <nudge>")`: the marker the copy reads
(kit/stubs.py). Functions are found by name with `ast` and rewritten by line range.

What a copy needs that the project does not, the copy gets here, written in: each command's first
statement stops it in one line while an assignment it needs is a stub (kit/stubs.py); each notebook's
first code cell has its cells that need an unwritten assignment say so and be skipped, and lets a model
whose own code is a stub load as a stand-in (kit/notebook_guard.py). Every other file is copied byte for
byte, but notebook outputs that print a stubbed function's source. See docs/instructors.md.
"""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import stubs  # noqa: E402
from grading import (MAPPING, UsageError, body_range, find_function, get_body, graded_in_sequence,  # noqa: F401
                     load_assignments, load_mapping, replace_body)

ROOT = Path(__file__).resolve().parents[1]
PRIVATE_DIR = "tests/private/"  # the instructor's own tests: never copied into a student version
# Outside a git checkout: directories and suffixes never copied (mirrors .gitignore).
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".benchmarks", ".whl", ".gl",
             "out", "runs", "checkpoints", "data"}
SKIP_SUFFIXES = (".pyc", ".pt")


# ----------------------------------------------------------------------------------------------
# The mapping (assignments.toml; grade.py reads it too, and finds functions by name the same way)

def get_assignment(mapping: dict, number) -> dict:
    assignments = mapping.get("assignment", {})
    if str(number) not in assignments:
        raise UsageError(f"no assignment {number!r} in {MAPPING}: choose one of {', '.join(assignments)}")
    return assignments[str(number)]


def later_assignments(mapping: dict, number) -> list[str]:
    """The assignments after `number` in assignments.toml: the order they are handed out in."""
    order = list(mapping["assignment"])
    return order[order.index(str(number)) + 1:]


def stubs_by_file(assignment: dict) -> dict[str, list[tuple[str, str]]]:
    """{"tree.py": [("build_tree_buffers", hint), ...]} from keys written "file:function"."""
    by_file = {}
    for key, hint in assignment["stubs"].items():
        file, _, name = key.partition(":")
        by_file.setdefault(file, []).append((name, hint))
    return by_file


def later_hint(number) -> str:
    """What a later assignment's stub says in the copy for `number`: no hint, it is not this copy's work."""
    return f"comes after assignment {number}; not part of this copy"


# ----------------------------------------------------------------------------------------------
# Stubbing: the body after the docstring becomes one raise

def stub_line(indent: str, number, name: str, hint: str, newline: str = "\n") -> str:
    message = f"assignment {number}: {name.rpartition('.')[2]}: {hint}"
    literal = f'"{message}"' if '"' not in message and "\\" not in message else repr(message)
    return f"{indent}raise NotImplementedError({literal}){newline}"


def stub_source(source: str, stubs: list[tuple[str, str]], number) -> str:
    """`source` with every (name, hint) in `stubs` reduced to its signature, docstring and one raise."""
    newline = "\r\n" if "\r\n" in source else "\n"
    for name, hint in stubs:
        _, _, indent = body_range(source, name)
        source = replace_body(source, name, [stub_line(indent, number, name, hint, newline)])
    ast.parse(source)  # still valid Python
    return source


# ----------------------------------------------------------------------------------------------
# The copy

def read_source(path) -> str:
    with open(path, encoding="utf-8", newline="") as f:  # newline="": keep the file's line endings
        return f.read()


def write_source(path, source: str):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(source)


def project_files(root: Path) -> list[str]:
    """Files of the project, relative to root: what git tracks or would track (.gitignore applies)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, check=True).stdout
        names = sorted(set(out.decode().split("\0")) - {""})
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk, skipping outputs and caches
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            names += [Path(folder, f).relative_to(root).as_posix() for f in files if not f.endswith(SKIP_SUFFIXES)]
    return sorted(n for n in names if (root / n).is_file())  # git also lists tracked files deleted since


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _toml_value(v) -> str:
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"


def _toml_entry(number, assignment: dict, hints: bool) -> list[str]:
    out = [f"\n[assignment.{number}]\n", f"title = {_toml_string(assignment['title'])}\n"]
    if assignment.get("notebooks"):
        out.append(f"notebooks = {_toml_value(assignment['notebooks'])}\n")
    for key in ("tests", "efficiency", "private"):
        items = "".join(f"\n    {_toml_string(t)}," for t in assignment.get(key, []))
        out.append(f"{key} = [{items}\n]\n" if items else f"{key} = []\n")
    out.append(f"\n[assignment.{number}.stubs]\n")
    out += [f"{_toml_string(k)} = {_toml_string(v)}\n" for k, v in assignment["stubs"].items()]
    if hints and assignment.get("hints"):
        out.append(f"\n[assignment.{number}.hints]\n")
        out += [f"{_toml_string(k)} = {_toml_string(v)}\n" for k, v in assignment["hints"].items()]
    return out


def student_mapping(number, assignment: dict, later: dict[str, dict] = {}, tables: dict = {}) -> str:
    """assignments.toml for a student version: its assignment (the default of `python kit/grade.py`), with
    its tests and full hints; then the later assignments, stubbed here, with no hints: grade.py needs their
    tests (correctness and efficiency) to know which of this assignment's tests wait for them. tables: the
    project's [commands] and [drafters], which the copy's commands read to stop (kit/stubs.py)."""
    out = [f"# Written by kit/make_assignment.py: assignment {number}, graded with: python kit/grade.py\n",
           f"default = {_toml_string(str(number))}\n"]
    for name in ("commands", "drafters"):
        if tables.get(name):
            out.append(f"\n[{name}]\n")
            out += [f"{_toml_string(k)} = {_toml_value(v)}\n" for k, v in tables[name].items()]
    out += _toml_entry(number, assignment, hints=True)
    for m, a in later.items():
        stubs = {key: later_hint(number) for key in a["stubs"]}
        out += _toml_entry(m, dict(title=a["title"], tests=a["tests"], efficiency=a.get("efficiency", []),
                                   private=a.get("private", []), stubs=stubs), hints=False)
    return "".join(out)


def command_lines(mapping: dict, stubbed) -> list[str]:
    """For ASSIGNMENT.md: what each command of [commands] waits for in a copy where the assignments
    `stubbed` are stubs, with its default drafters, and what another drafter changes."""
    stubbed = {int(n) for n in stubbed}

    def numbers(ns):
        return f"assignment{'s' if len(ns) > 1 else ''} {', '.join(map(str, ns))}"
    lines = []
    for command, entry in mapping.get("commands", {}).items():
        now = sorted(set(stubs.needed(command, [], mapping)) & stubbed)
        line = f"`python {command}` " + (f"waits for {numbers(now)}" if now else "runs")
        changes = {}
        for drafter in mapping.get("drafters", {}) if "drafters" in entry else ():
            other = sorted(set(stubs.needed(command, [entry["drafters"], drafter], mapping)) & stubbed)
            if other != now:
                says = (f"also waits for {numbers(sorted(set(other) - set(now)))}" if now and set(other) > set(now)
                        else f"waits for {numbers(other)}" if other else "runs")
                changes.setdefault(says, []).append(f"`{entry['drafters']} {drafter}`")
        line += "".join(f"; with {' or '.join(flags)}, it {says}" for says, flags in changes.items())
        lines.append(line)
    return lines


def student_note(number, assignment: dict, line_numbers: dict[str, int], graded: list[str],
                 waiting: dict[str, list[str]], efficiency: list[str] = (), commands: list[str] = ()) -> str:
    """ASSIGNMENT.md: what to implement and how to grade it. graded: the correctness tests run now;
    efficiency: the efficiency tests run now; waiting: {later assignment: tests of either kind};
    commands: one line for each command, what it waits for."""
    rows = "".join(f"| `{key.partition(':')[2]}` | `{key.partition(':')[0]}` line {line_numbers[key]} | {hint} |\n"
                   for key, hint in assignment["stubs"].items())
    tests = "".join(f"- `{t}`\n" for t in graded)
    if efficiency:
        tests += ("\nEfficiency (what a step costs, reported beside the reference's figures and never failed):\n\n"
                  + "".join(f"- `{t}`\n" for t in efficiency))
    private = (f"\nYour instructor also runs {len(assignment['private'])} private test(s) when grading.\n"
               if assignment.get("private") else "")
    later = ""
    if waiting:
        kind = {t: ", efficiency" for t in assignment.get("efficiency", [])}
        later = ("\nThese tests also check your functions, end to end, but need later assignments; they are "
                 "graded with those (`python kit/grade.py` lists them as LATER):\n\n"
                 + "".join(f"- `{t}` (assignment {m}{kind.get(t, '')})\n" for m, ts in waiting.items() for t in ts))
    name = next(iter(assignment["stubs"])).partition(":")[2].rpartition(".")[2]
    runs = "".join(f"  - {line};\n" for line in commands)
    return f"""# Assignment {number}: {assignment['title']}

In this copy of medusa-mini, the functions below keep their signature and docstring, which states
what each must do, and their body raises `NotImplementedError` with a short nudge. Implement them.
The functions of later assignments are stubs too, with no hint: they are not part of this assignment.

What runs in this copy now, and what waits:
- **The notebooks** (`jupyter lab notebooks/`) run top to bottom, on a model your instructor trained
  with the reference code (in `out/tiny/`, and in `out/` when there was a full run): a cell that needs
  an assignment not written yet prints one line saying which, and is skipped (the first code cell of
  each notebook, written into this copy, arranges it). To run them all as the tests do:
  `MEDUSA_FAST=1 python -m pytest -p nbmake --nbmake notebooks`.
- **The commands** stop with one line naming the first assignment they wait for, before they load or
  train anything (their first line, written into this copy, checks it); `sample.py --out out/tiny`
  uses the model the copy came with:
{runs}
| function | where | nudge |
|---|---|---|
{rows}
Stuck? `python kit/grade.py --hint NAME` prints the full hint for a function, e.g.
`python kit/grade.py --hint {name}`. Try the docstring and the failing test's message first.

## Grade yourself

```bash
python kit/grade.py
```

runs exactly the tests that grade this assignment and prints PASS or FAIL per test with the
number of cases passed, and for a failure what differed; then `correct: yes` or `no`, and on its own
line what a step costs (`efficiency:` ops and host reads per step against the reference's and the
bounds, once a whole step runs). It exits with 0 when every correctness test passes, however many
ops your step takes.
`python -m pytest "TEST"` runs one test, with its traceback. (The
whole suite, `python -m pytest`, also runs tests of later assignments, which fail in this copy.)
The tests:

{tests}{later}{private}"""


# ----------------------------------------------------------------------------------------------
# What a copy gets written in: the commands' stop, the notebooks' guard

COMMAND_GUARD = ("import kit.stubs; kit.stubs.stop_while_waiting(__name__, __file__)  # written by "
                 "kit/make_assignment.py: in this copy, stop in one line while an assignment this command needs "
                 "is a stub\n")
NOTEBOOK_GUARD = [
    "# Written into this copy by kit/make_assignment.py: a cell that needs an assignment still to write here\n",
    "# says so in one line and is skipped; a model whose own code is still a stub loads as a stand-in.\n",
    "import course  # noqa: F401  (the project on sys.path)\n",
    "from kit import notebook_guard\n",
    "notebook_guard.watch()",
]


def guard_command(source: str) -> str:
    """A command's source with COMMAND_GUARD as its first statement (after its docstring and any
    `from __future__` import), so it runs before the command imports anything."""
    module = ast.parse(source)
    after = 0
    for node in module.body:
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and node is module.body[0]) or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            after = node.end_lineno
        else:
            break
    newline = "\r\n" if "\r\n" in source else "\n"
    lines = source.splitlines(keepends=True)
    return "".join(lines[:after] + [COMMAND_GUARD.replace("\n", newline)] + lines[after:])


def guard_notebook(notebook: str) -> str:
    """A notebook with NOTEBOOK_GUARD as a new code cell before its first code cell."""
    nb = json.loads(notebook)
    cells = nb.get("cells", [])
    first = next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"), len(cells))
    cell = dict(cell_type="code", execution_count=None, metadata={}, outputs=[], source=NOTEBOOK_GUARD)
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
        cell = dict(id="kit-notebook-guard", **cell)
    cells.insert(first, cell)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def solution_lines(root: Path, files: list[str], keys) -> dict[str, list[str]]:
    """{"file:function": the lines of its body found in no other Python file or function of the
    project}: the lines that would give its solution away wherever else they appear."""
    python = {f: read_source(root / f) for f in files if f.endswith(".py")}
    out = {}
    for key in keys:
        file, _, name = key.partition(":")
        body = "".join(get_body(python[file], name))
        rest = "".join(t for f, t in python.items() if f != file) + python[file].replace(body, "")
        out[key] = [line.strip() for line in body.splitlines() if len(line.strip()) > 20 and line.strip() not in rest]
    return out


def clear_leaking_outputs(notebook: str, lines) -> str:
    """The notebook with the outputs cleared of every cell whose outputs show one of `lines` (a
    stubbed function's source printed with inspect.getsource, say); unchanged if there is none."""
    nb = json.loads(notebook)
    changed = False
    for cell in nb.get("cells", []):
        shown = json.dumps(cell.get("outputs", []), ensure_ascii=False)
        if any(json.dumps(line, ensure_ascii=False)[1:-1] in shown for line in lines):
            cell["outputs"], changed = [], True
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n" if changed else notebook


RUN_FILES = (".pt", ".tiktoken", ".source.json", ".npy", ".key.json")  # checkpoints, tokenizer, token ids


def copy_trained_runs(root: Path, out: Path):
    """The instructor's trained models into a copy, for its notebooks and sample.py, which then need no
    pipeline: the tiny preset's run (trained now with the reference code when there is none) into
    out/tiny/, and the full run, where it has finished, into out/. The one place the kit calls the lab
    (lab/runs.py: tiny_run, run_finished)."""
    from lab import runs  # torch: only when a copy gets a model
    found = [Path(runs.tiny_run(root / "out"))]
    if runs.run_finished(root / "out" / "medusa.pt"):
        found.append(root / "out")
    for run in found:
        target = out / run.relative_to(root)
        target.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(run):
            if name.endswith(RUN_FILES) and (run / name).is_file():
                shutil.copy2(run / name, target / name)


def restore_bodies(copy, assignment: dict, root=ROOT):
    """What a student does, done with the reference's bodies: put them back into every stub of `assignment`
    in the student version at `copy` (the kit's self-check; an instructor checking a copy by hand)."""
    for file, functions in stubs_by_file(assignment).items():
        original, source = read_source(Path(root) / file), read_source(Path(copy) / file)
        for name, _ in functions:
            source = replace_body(source, name, get_body(original, name))
        write_source(Path(copy) / file, source)


NO_TESTS = {"tests": {}}  # a reach map for copies whose test lists do not matter (the kit's own checks)


def make_assignment(number, out, root=ROOT, in_sequence=True, models=True, reach=None) -> list[str]:
    """Copy the project at `root` into `out` with assignment `number` stubbed, and (in_sequence) every
    later assignment's functions stubbed without a hint, and (models) the instructor's trained runs
    (copy_trained_runs); the commands' stop and the notebooks' guard written in; the copy's tests listed
    in its assignments.toml and ASSIGNMENT.md from `reach` (kit/reach.py's map; None: read from out/kit/,
    or learned now by running the graded files). Return the project files written."""
    root, out = Path(root).resolve(), Path(out).resolve()
    mapping = load_mapping(root / MAPPING)
    get_assignment(mapping, number)
    if out.is_relative_to(root) and not out.is_relative_to(root / "out"):
        raise UsageError(f"write student versions under out/ (ignored by git) or outside the project, not {out}")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty: give a new directory")
    assignments = load_assignments(mapping, root, note=lambda line: print(line, file=sys.stderr), data=reach)
    number = str(number)
    assignment = assignments[number]
    later = {m: assignments[m] for m in later_assignments(mapping, number)} if in_sequence else {}
    skip = tuple(mapping.get("exclude", [])) + (PRIVATE_DIR,)
    files = [f for f in project_files(root) if not f.startswith(skip)]

    stubbed, line_numbers = {}, {}  # stub everything before writing anything
    for n, a, hint in [(number, assignment, None)] + [(m, a, later_hint(number)) for m, a in later.items()]:
        for file, functions in stubs_by_file(a).items():
            if file not in files:
                raise UsageError(f"{file} (stubs of assignment {n}) is not a project file")
            source = stubbed.get(file) or read_source(root / file)
            try:
                stubbed[file] = stub_source(source, [(name, hint or h) for name, h in functions], n)
            except (LookupError, ValueError) as e:  # the mapping names a function the file does not hold
                raise UsageError(f"{MAPPING}, assignment {n}, {file}: {e}") from None
    for key in assignment["stubs"]:
        file, _, name = key.partition(":")
        line_numbers[key] = find_function(ast.parse(stubbed[file]), name).lineno
    commands = [c for c in mapping.get("commands", {}) if c in files]
    for command in commands:
        stubbed[command] = guard_command(stubbed.get(command) or read_source(root / command))

    stubbed_keys = [k for a in [assignment, *later.values()] for k in a["stubs"]]
    secret = [line for lines in solution_lines(root, files, stubbed_keys).values() for line in lines]
    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        if f.endswith(".ipynb"):  # outputs that print a stubbed function's source would give it away
            write_source(out / f, guard_notebook(clear_leaking_outputs(read_source(root / f), secret)))
        elif f not in stubbed:
            shutil.copy2(root / f, out / f)
    for file, source in stubbed.items():
        write_source(out / file, source)
        shutil.copymode(root / file, out / file)
    if models:
        copy_trained_runs(root, out)
    tables = {name: mapping.get(name, {}) for name in ("commands", "drafters")}
    (out / MAPPING).write_text(student_mapping(number, assignment, later, tables), encoding="utf-8")
    waiting = {}
    for key in ("tests", "efficiency"):
        for spec in assignment.get(key, []):
            for m in later:
                if spec not in graded_in_sequence({number: assignment, m: later[m]}, number, key):
                    waiting.setdefault(m, []).append(spec)
                    break
    graded, efficiency = ([t for t in assignment.get(key, []) if not any(t in ts for ts in waiting.values())]
                          for key in ("tests", "efficiency"))
    note = student_note(number, assignment, line_numbers, graded, waiting, efficiency,
                        command_lines(mapping, [number, *later]))
    (out / "ASSIGNMENT.md").write_text(note, encoding="utf-8")
    return sorted(set(files) | {MAPPING, "ASSIGNMENT.md"})


def print_table(mapping: dict, assignments: dict):
    for number, a in assignments.items():
        print(f"Assignment {number}: {a['title']}")
        print("  stubs:  " + ", ".join(k.replace(":", " ") for k in a["stubs"]))
        if a.get("notebooks"):
            print("  shown in: " + ", ".join(f"notebooks/{name}" for name in a["notebooks"]))
        now = graded_in_sequence(assignments, number)
        print(f"  graded by {len(a['tests'])} tests" + (f" + {len(a['private'])} private" if a.get("private") else "")
              + f"; handed out in sequence, {len(a['tests']) - len(now)} of them wait for later assignments (LATER)")
        for t in a["tests"]:
            print(f"    {t}" + ("" if t in now else "  (LATER)"))
        if a.get("efficiency"):
            now = graded_in_sequence(assignments, number, "efficiency")
            print("  efficiency, reported apart:")
            for t in a["efficiency"]:
                print(f"    {t}" + ("" if t in now else "  (LATER)"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def main(argv=None):
    parser = _Parser(description="Write a student version of medusa-mini for one assignment.")
    parser.add_argument("number", nargs="?", help="the assignment to stub, as numbered in assignments.toml")
    parser.add_argument("--out", help="directory to write the student version into (new or empty; default: "
                                      "out/assignment-N)")
    parser.add_argument("--list", action="store_true", help="print the assignments and exit")
    parser.add_argument("--keep-later", action="store_true",
                        help="leave later assignments' functions solved (their reference code is then in the "
                             "copy): only for an assignment handed out on its own")
    try:
        args = parser.parse_args(argv)
        if args.list:
            mapping = load_mapping(ROOT / MAPPING)
            print_table(mapping, load_assignments(mapping, ROOT, note=lambda line: print(line, file=sys.stderr)))
            return 0
        if args.number is None:
            raise UsageError("give an assignment number (or --list)")
        if args.out is not None and not args.out.strip():
            raise UsageError("--out: give a directory")
        args.out = args.out or str(ROOT / "out" / f"assignment-{args.number}")
        files = make_assignment(args.number, args.out, in_sequence=not args.keep_later)
    except (UsageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mapping = load_mapping(ROOT / MAPPING)
    a = get_assignment(mapping, args.number)
    later = [] if args.keep_later else later_assignments(mapping, args.number)
    print(f"Wrote {len(files)} files to {args.out}: assignment {args.number}, {a['title']}.")
    print(f"Stubbed: {', '.join(k.replace(':', ' ') for k in a['stubs'])}"
          + (f"; and, with no hint, the functions of assignment(s) {', '.join(later)}." if later else "."))
    print(f"Students read {os.path.join(args.out, 'ASSIGNMENT.md')} and grade with: cd {args.out} && python kit/grade.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
