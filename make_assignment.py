"""Write a student version of medusa-mini for one course assignment.

    python make_assignment.py --list                       # the assignments, what they stub, what grades them
    python make_assignment.py 2 --out out/assignment-2     # the whole project, assignment 2 stubbed

assignments.toml says, for each assignment, which functions become stubs and which tests grade it.
A stub keeps its decorators, signature and docstring; its body becomes one line,
`raise NotImplementedError("Assignment N: <hint>")`. Functions are found by name with `ast` and
rewritten by line range, so the rest of every file is copied byte for byte and the source carries
no solution markers. See the README, "For instructors".
"""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MAPPING = "assignments.toml"
PRIVATE_DIR = "tests/private/"  # the instructor's own tests: never copied into a student version
# Outside a git checkout: directories and suffixes never copied (mirrors .gitignore).
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".benchmarks", ".whl", ".gl",
             "out", "runs", "checkpoints", "data"}
SKIP_SUFFIXES = (".pyc", ".pt")


# ----------------------------------------------------------------------------------------------
# The mapping (assignments.toml)

def load_mapping(path=ROOT / MAPPING) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def get_assignment(mapping: dict, number) -> dict:
    assignments = mapping.get("assignment", {})
    if str(number) not in assignments:
        raise ValueError(f"no assignment {number!r} in {MAPPING}: choose one of {', '.join(assignments)}")
    return assignments[str(number)]


def stubs_by_file(assignment: dict) -> dict[str, list[tuple[str, str]]]:
    """{"tree.py": [("build_tree_buffers", hint), ...]} from keys written "file:function"."""
    by_file = {}
    for key, hint in assignment["stubs"].items():
        file, _, name = key.partition(":")
        by_file.setdefault(file, []).append((name, hint))
    return by_file


# ----------------------------------------------------------------------------------------------
# Stubbing by line range: find the def with ast, replace the lines after its docstring

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


def stub_line(indent: str, number, hint: str, newline: str = "\n") -> str:
    message = f"Assignment {number}: {hint}"
    literal = f'"{message}"' if '"' not in message and "\\" not in message else repr(message)
    return f"{indent}raise NotImplementedError({literal}){newline}"


def stub_source(source: str, stubs: list[tuple[str, str]], number) -> str:
    """`source` with every (name, hint) in `stubs` reduced to its signature, docstring and one raise."""
    newline = "\r\n" if "\r\n" in source else "\n"
    for name, hint in stubs:
        _, _, indent = body_range(source, name)
        source = replace_body(source, name, [stub_line(indent, number, hint, newline)])
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


def student_mapping(number, assignment: dict) -> str:
    """assignments.toml for a student version: only its own assignment, so `python grade.py` needs no number."""
    out = [f"# Written by make_assignment.py: the one assignment of this copy. Grade it with: python grade.py\n",
           f"\n[assignment.{number}]\n",
           f"title = {_toml_string(assignment['title'])}\n"]
    for key in ("tests", "private"):
        items = "".join(f"\n    {_toml_string(t)}," for t in assignment.get(key, []))
        out.append(f"{key} = [{items}\n]\n" if items else f"{key} = []\n")
    out.append(f"\n[assignment.{number}.stubs]\n")
    out += [f"{_toml_string(k)} = {_toml_string(v)}\n" for k, v in assignment["stubs"].items()]
    return "".join(out)


def student_note(number, assignment: dict, line_numbers: dict[str, int]) -> str:
    """ASSIGNMENT.md: what to implement and how to grade it."""
    rows = "".join(f"| `{key.partition(':')[2]}` | `{key.partition(':')[0]}` line {line_numbers[key]} | {hint} |\n"
                   for key, hint in assignment["stubs"].items())
    tests = "".join(f"- `{t}`\n" for t in assignment["tests"])
    private = (f"\nYour instructor also runs {len(assignment['private'])} private test(s) when grading.\n"
               if assignment.get("private") else "")
    return f"""# Assignment {number}: {assignment['title']}

Everything in this copy of medusa-mini works except the functions below: each keeps its signature
and docstring, and its body raises `NotImplementedError` with a hint. Implement them.

| function | where | hint |
|---|---|---|
{rows}
## Grade yourself

```bash
python grade.py
```

runs exactly the tests that grade this assignment and prints PASS or FAIL per test with the
number of cases passed; it exits with 0 only when all pass. To see why a test fails:
`python grade.py --tb short`, or `python -m pytest "TEST"` with a name from the list below.
The tests:

{tests}{private}
Other tests of the project (`python -m pytest`) that need your functions fail until they are
done; all the others already pass.
"""


def make_assignment(number, out, root=ROOT) -> list[str]:
    """Copy the project at `root` into `out` with assignment `number` stubbed; return the files written."""
    root, out = Path(root).resolve(), Path(out).resolve()
    mapping = load_mapping(root / MAPPING)
    assignment = get_assignment(mapping, number)
    if out.is_relative_to(root) and not out.is_relative_to(root / "out"):
        raise ValueError(f"write student versions under out/ (ignored by git) or outside the project, not {out}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: give a new directory")
    skip = tuple(mapping.get("exclude", [])) + (PRIVATE_DIR,)
    files = [f for f in project_files(root) if not f.startswith(skip)]

    stubbed, line_numbers = {}, {}  # stub everything before writing anything
    for file, stubs in stubs_by_file(assignment).items():
        if file not in files:
            raise FileNotFoundError(f"{file} (stubs of assignment {number}) is not a project file")
        stubbed[file] = stub_source(read_source(root / file), stubs, number)
        for name, _ in stubs:
            line_numbers[f"{file}:{name}"] = find_function(ast.parse(stubbed[file]), name).lineno

    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, out / f)
    for file, source in stubbed.items():
        write_source(out / file, source)
    (out / MAPPING).write_text(student_mapping(number, assignment), encoding="utf-8")
    (out / "ASSIGNMENT.md").write_text(student_note(number, assignment, line_numbers), encoding="utf-8")
    return sorted(set(files) | {MAPPING, "ASSIGNMENT.md"})


def print_table(mapping: dict):
    for number, a in mapping["assignment"].items():
        print(f"Assignment {number}: {a['title']}")
        print("  stubs:  " + ", ".join(k.replace(":", " ") for k in a["stubs"]))
        print(f"  graded by {len(a['tests'])} tests" + (f" + {len(a['private'])} private" if a.get("private") else ""))
        for t in a["tests"]:
            print(f"    {t}")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write a student version of medusa-mini for one assignment.")
    parser.add_argument("number", nargs="?", help="the assignment to stub, as numbered in assignments.toml")
    parser.add_argument("--out", help="directory to write the student version into (new or empty)")
    parser.add_argument("--list", action="store_true", help="print the assignments and exit")
    args = parser.parse_args(argv)
    if args.list:
        print_table(load_mapping())
        return 0
    if args.number is None or args.out is None:
        parser.error("give an assignment number and --out DIR (or --list)")
    try:
        files = make_assignment(args.number, args.out)
    except (ValueError, FileExistsError, FileNotFoundError, LookupError) as e:
        print(f"make_assignment.py: error: {e}", file=sys.stderr)
        return 2
    a = get_assignment(load_mapping(), args.number)
    print(f"Wrote {len(files)} files to {args.out}: assignment {args.number}, {a['title']}.")
    print(f"Stubbed: {', '.join(k.replace(':', ' ') for k in a['stubs'])}.")
    print(f"Students read {os.path.join(args.out, 'ASSIGNMENT.md')} and grade with: cd {args.out} && python grade.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
