"""Stubs in a student copy of the project (kit/make_assignment.py): a function whose body is one line,
`raise NotImplementedError("assignment N: name: ...")`. The marker is the message itself, so the copy
reads its own stubs from its source, whatever the student has written since it was made.

It also holds the stop make_assignment.py writes into a copy's commands: their first statement,

    import kit.stubs; kit.stubs.stop_while_waiting(__name__, __file__)  # written by kit/make_assignment.py: ...

which, when the command runs as a script, checks the functions of the assignments it needs
([commands] and [drafters] of the copy's kit/assignments.toml) before it loads or trains anything, and
while one is a stub stops with one line, `error: COMMAND needs assignment N (...)`, and exit status 1.
The reference project has no such line: its commands know nothing of copies. This module imports only
the standard library, so the stop costs a command no import of torch.
"""
import ast
import os
import sys

KIT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(KIT)  # the project (or the copy): the kit is one folder down
MAPPING = os.path.join(KIT, "assignments.toml")


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


def assignment_of(message: str) -> int | None:
    """The assignment a stub's message names ("assignment 3: evaluate_posterior: ..." -> 3), or None."""
    words = str(message).split()
    if len(words) > 1 and words[0] == "assignment" and words[1].rstrip(":").isdigit():
        return int(words[1].rstrip(":"))
    return None


def root_modules(root=ROOT) -> list[str]:
    """The project's root modules (the core and the commands), where a copy's stubs are."""
    return sorted(name[:-3] for name in os.listdir(root) if name.endswith(".py"))


def stubs_in(modules=None, root=ROOT) -> list[tuple[int, str, str]]:
    """(assignment, "file:function", its message) for every stub in the given root modules (names, as
    imported; default: all of them)."""
    found = []
    for module in sorted(set(root_modules(root) if modules is None else modules)):
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
                    if message and assignment_of(message) is not None:
                        found.append((assignment_of(message), f"{os.path.basename(path)}:{prefix}{node.name}", message))
        walk(tree.body, "")
    return sorted(found)


def written(number: int, root=ROOT) -> bool:
    """Whether assignment `number` is written here: no stub of the project's root modules carries it."""
    return not any(n == number for n, _, _ in stubs_in(root=root))


def waiting_line(command: str, number: int, keys) -> str:
    """What a command says when it stops for an assignment still to write."""
    return (f"{command} needs assignment {number} ({', '.join(keys)}), still to write in this copy: write it, "
            f"then check it with `python kit/grade.py {number}`")


# ----------------------------------------------------------------------------------------------
# The commands' stop, in a copy

def _flag(argv, flag) -> str | None:
    """The value given to `flag` in argv (`--flag VALUE` or `--flag=VALUE`; the last one wins), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def needed(command: str, argv, mapping: dict) -> list[int]:
    """The assignments a command runs with these arguments: its own `needs`, and those of the drafters
    it runs (named by its `drafters` flag, or its `default`). [] for a command the table does not name."""
    entry = mapping.get("commands", {}).get(command)
    if entry is None:
        return []
    numbers = set(entry.get("needs", []))
    if "drafters" in entry:
        names = _flag(argv, entry["drafters"]) or entry.get("default", "")
        for name in names.split(","):
            numbers |= set(mapping.get("drafters", {}).get(name.strip(), []))
    return sorted(int(n) for n in numbers)


def stop_while_waiting(name: str, path: str, argv=None, mapping_path=MAPPING):
    """The first statement of a command in a copy: when it runs as a script (name == "__main__") and a
    function of an assignment it needs is a stub here, one line on stderr and exit status 1, before the
    command imports, loads or trains anything. Its help (-h, --help) is always shown."""
    if name != "__main__":
        return
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        return
    import tomllib
    try:
        with open(mapping_path, "rb") as f:
            mapping = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return  # no table to read: the command runs, and stops where it reaches a stub
    root = os.path.dirname(os.path.abspath(path))
    command = os.path.basename(path)
    numbers = needed(command, argv, mapping)
    stubs = [(n, key) for n, key, _ in stubs_in(root=root) if n in numbers]
    if stubs:
        first = stubs[0][0]
        print(f"error: {waiting_line(command, first, [key for n, key in stubs if n == first])}", file=sys.stderr)
        sys.exit(1)
