"""House rules that a reader of the whole repository relies on, checked on every tracked file:

- a base's name ("gpt", "smollm2") is compared only in the base registry (lab/bases.py), as a drafter's
  name is only in the drafter registry (tests/test_registry.py);
- a checkpoint's fields are read by name only in lab/checkpoints.py: everything else reads the
  Checkpoint dataclass's attributes;
- the product reads as if no course kit existed: no command, library module, test outside kit/tests,
  notebook or page (docs/instructors.md aside) mentions stubs, student copies or assignments.
"""
import ast
import json
import re
import subprocess
from pathlib import Path

from test_registry import name_dispatch

ROOT = Path(__file__).resolve().parents[1]
BASES = {"gpt", "smollm2"}


def tracked(*patterns) -> list[str]:
    """The repository's files (tracked, or new and not ignored) matching the git patterns."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    return [f for f in files if (ROOT / f).exists()]


def python_files(skip=()):
    return [f for f in tracked("*.py") if not f.startswith(("kit/", *skip))]


def test_only_the_base_registry_compares_a_bases_name():
    problems = []
    for f in python_files(skip=("tests/", "lab/bases.py")):
        problems += [f"{f}, {where}" for where in name_dispatch(ast.parse((ROOT / f).read_text()), BASES)]
    assert not problems, "\n".join(problems)


def checkpoint_reads(tree) -> list[str]:
    """Where a parsed file reads a checkpoint by string key: `ckpt["model"]`, `checkpoint.get("done")`, and the
    like, on any name that says it holds a checkpoint (ckpt, checkpoint, saved, *_ckpt)."""
    def is_checkpoint(node):
        return isinstance(node, ast.Name) and re.fullmatch(r"(\w+_)?(ckpt|checkpoint|saved)", node.id) is not None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_checkpoint(node.value) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and is_checkpoint(node.func.value) and node.args and isinstance(node.args[0], ast.Constant):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_checkpoint_module_reads_a_checkpoint_by_key():
    problems = []
    for f in python_files(skip=("lab/checkpoints.py",)):
        problems += [f"{f}, {where}" for where in checkpoint_reads(ast.parse((ROOT / f).read_text()))]
    for f in tracked("notebooks/*.ipynb"):
        cells = json.loads((ROOT / f).read_text())["cells"]
        code = "\n".join(l for c in cells if c["cell_type"] == "code" for l in "".join(c["source"]).splitlines()
                         if not l.lstrip().startswith(("%", "!")))
        problems += [f"{f}, {where}" for where in checkpoint_reads(ast.parse(code))]
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_they_look_for():
    code = 'if base == "gpt": pass\nx = {"smollm2": 1}\nckpt["model"]\nplain_ckpt.get("done")\nckpt.model["w"]\n'
    assert len(name_dispatch(ast.parse(code), BASES)) == 2
    assert checkpoint_reads(ast.parse(code)) == ["line 3: ckpt['model']", "line 4: plain_ckpt.get('done')"]


KIT_WORDS = re.compile(r"\bstubs?\b|\bstubbed\b|\bassignments?\b|student cop(y|ies)|make_assignment|kit/grade|"
                       r"course\.needs", re.IGNORECASE)


def test_the_product_knows_nothing_of_student_copies():
    """Every text file of the product: the kit (kit/, its tests) and the instructors' page excepted."""
    problems = []
    for f in tracked():
        if f.startswith("kit/") or f == "docs/instructors.md" or f == "tests/test_house.py" or \
                not f.endswith((".py", ".md", ".ipynb", ".txt", ".toml", ".ini", ".cfg")) or f.startswith("docs/results"):
            continue
        for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), start=1):
            if KIT_WORDS.search(line):
                problems.append(f"{f}:{n}: {line.strip()[:120]}")
    assert not problems, "\n".join(problems)
