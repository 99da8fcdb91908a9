"""Stubs in a student copy of the project (kit/make_assignment.py): a function whose body is one line,
`raise NotImplementedError("assignment N: name: ...")`. The marker is the message itself, so a command
reads it from the source without the kit: before it loads or trains anything, it checks that the
functions it will run are written (require_written), and stops with one line naming the assignment.
"""
import ast
import os

from lab.cli import RunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("verify", "tree", "medusa_mini")  # what every command runs: the verifier, the tree, the base and plain decoding


def stub_message(function) -> str | None:
    """The marker of a stubbed function (an ast def), or None: its body after the docstring is one
    `raise NotImplementedError("assignment ...")`."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return None
    call = body[0].exc
    if getattr(call.func, "id", None) != "NotImplementedError" or not call.args:
        return None
    message = call.args[0]
    if isinstance(message, ast.Constant) and isinstance(message.value, str) and message.value.startswith("assignment "):
        return message.value
    return None


def stubs_in(modules, root=ROOT) -> list[tuple[int, str, str]]:
    """(assignment, "file:function", its message) for every stub in the given core modules (names, as imported)."""
    found = []
    for module in sorted(set(modules)):
        path = os.path.join(root, module.replace(".", os.sep) + ".py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())

        def walk(nodes, prefix):
            for node in nodes:
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    message = stub_message(node)
                    if message:
                        number = int(message.split()[1].rstrip(":"))
                        found.append((number, f"{os.path.basename(path)}:{prefix}{node.name}", message))
        walk(tree.body, "")
    return sorted(found)


def written(number: int, root=ROOT) -> bool:
    """Whether assignment `number` is written here: no stub of the project's root modules carries it."""
    modules = [name[:-3] for name in os.listdir(root) if name.endswith(".py")]
    return not any(n == number for n, _, _ in stubs_in(modules, root))


def require_written(command: str, modules, unused=()):
    """Stop a command (RunError, one line) before it does anything when a function it runs is a stub: any
    function of the core and of `modules`, but those named in `unused` ("file:function": what the command
    never calls)."""
    stubs = [s for s in stubs_in(set(CORE) | set(modules)) if s[1] not in unused]
    if stubs:
        number = stubs[0][0]
        names = ", ".join(key for n, key, _ in stubs if n == number)
        raise RunError(f"{command} needs assignment {number} ({names}), still to write in this copy: write it, "
                       f"then check it with `python kit/grade.py {number}`")
