"""The house: the core at the root, the lab (lab/) and the course kit (kit/) one floor down, and imports
that run one way, kit -> lab -> core. A command (a file with `if __name__ == "__main__"`) imports the
lab and the core, never another command nor the kit; no core or lab module imports the kit or a
command; the notebooks import no command; the imports form no circle. Every import is read, those
inside functions too."""
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


FILES = {module_name(p): p for p in [*ROOT.glob("*.py"), *ROOT.glob("lab/*.py"), *ROOT.glob("kit/*.py"),
                                     *ROOT.glob("tools/*.py")]}
FILES["course"] = ROOT / "notebooks" / "course.py"
KIT_NAMES = {name.split(".")[-1] for name in FILES if name.startswith("kit.")}  # the kit imports its own by bare name


def floor(name: str) -> str:
    if name.startswith("kit.") or name in KIT_NAMES:
        return "kit"
    if name in COMMANDS or name.startswith("tools."):
        return "command"
    if name.startswith("lab") or name == "course":
        return "lab"
    return "core"


def imported(tree) -> set[str]:
    """The project modules a parsed file imports, anywhere in it (a package import as its module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    found = set()
    for name in names:
        if name in FILES:
            found.add(name)
        elif name in KIT_NAMES:
            found.add(f"kit.{name}")
    return found


def is_command(tree) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in FILES.items()}
COMMANDS = {name for name, tree in TREES.items() if is_command(tree)}
GRAPH = {name: imported(tree) - {name} for name, tree in TREES.items()}


def test_the_first_ls_shows_the_core_and_the_everyday_commands():
    """At the root: the core a student reads and the commands a user runs; the lab and the kit below."""
    root = {p.stem for p in ROOT.glob("*.py")}
    assert {"medusa_mini", "kv_cache", "tree", "verify", "eagle", "eagle3", "mtp", "feature_drafter", "smollm"} <= root
    # tools/ holds the maintainers' commands (the GPU run), not everyday ones; the lab holds no command
    assert {c for c in COMMANDS if "." not in c} == {"train_heads", "benchmark", "sample", "ablation", "export"}
    assert not {c for c in COMMANDS if c.startswith("lab.")}, "a command lives at the root, in tools/ or in kit/"
    assert {c for c in COMMANDS if c.startswith("tools.")} == {"tools.gpu_check"}
    assert root == {"medusa_mini", "kv_cache", "tree", "verify", "eagle", "eagle3", "mtp", "feature_drafter", "smollm", "train_heads",
                    "benchmark", "sample", "ablation", "export"}, root
    assert not list(ROOT.glob("*.toml")), "the kit's TOML files live in kit/"


def test_imports_run_kit_to_lab_to_core():
    """The core imports only the core; the lab the lab and the core; a command the lab and the core; the
    kit anything below it."""
    order = {"core": 0, "lab": 1, "command": 2, "kit": 3}
    arrows = [f"{name} ({floor(name)}) imports {other} ({floor(other)})" for name, others in GRAPH.items()
              for other in others if order[floor(other)] > order[floor(name)]]
    assert not arrows, "; ".join(arrows)


def test_no_module_imports_a_command():
    """Neither a library module nor a command imports a command: what two need lives in a library module."""
    arrows = [f"{name} imports the command {other}" for name, others in GRAPH.items() for other in others
              if other in COMMANDS]
    assert not arrows, "; ".join(arrows)


def test_the_notebooks_import_no_command_and_no_kit():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        lines = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        found = imported(ast.parse(lines))
        assert not found & COMMANDS and not {n for n in found if floor(n) == "kit"}, (path.name, found)


def test_the_imports_form_no_circle():
    """A depth-first walk of the import graph finds no module that leads back to itself."""
    state = {}  # name -> "open" while its imports are walked, "done" after

    def walk(name, path):
        state[name] = "open"
        for other in sorted(GRAPH[name]):
            if state.get(other) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(other):] + [other]))
            if other not in state:
                walk(other, path + [other])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])


def test_the_check_sees_an_import_inside_a_function():
    tree = ast.parse("def f():\n    import benchmark\n    from lab import drafters\n    from grading import x\n")
    assert imported(tree) == {"benchmark", "lab", "lab.drafters", "kit.grading"}
