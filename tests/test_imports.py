"""The house: library modules import no command, commands import only library modules, and the
imports form no circle. A command is a file with `if __name__ == "__main__"`; notebooks/course.py
and the notebooks count as library code. Every import is read, those inside functions too."""
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in sorted(ROOT.glob("*.py"))} | {"course": ROOT / "notebooks" / "course.py"}


def imported(tree) -> set[str]:
    """The project modules a parsed file imports, anywhere in it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(MODULES)


def is_command(tree) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
COMMANDS = {name for name, tree in TREES.items() if is_command(tree)}
GRAPH = {name: imported(tree) - {name} for name, tree in TREES.items()}


def test_the_commands_are_the_ones_users_run():
    assert COMMANDS == {"train_heads", "benchmark", "sample", "ablation", "grade", "make_assignment"}


def test_no_module_imports_a_command():
    """Neither a library module nor a command imports a command: what two need lives in a library module."""
    arrows = [f"{name} imports the command {other}" for name, others in GRAPH.items() for other in others
              if other in COMMANDS]
    assert not arrows, "; ".join(arrows)


def test_the_notebooks_import_no_command():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        lines = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        assert not imported(ast.parse(lines)) & COMMANDS, path.name


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
    tree = ast.parse("def f():\n    import benchmark\n    from train_heads import main\n")
    assert imported(tree) == {"benchmark", "train_heads"}
