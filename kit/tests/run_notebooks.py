"""Run notebooks of student copies top to bottom, in fast mode, one after the other in this one process:

    python kit/tests/run_notebooks.py COPY NOTEBOOK [COPY NOTEBOOK ...]     # prints JSON, one result each

Each notebook runs in a fresh IPython shell (the cells go through IPython as a kernel runs them: its
transformers, the guard make_assignment.py wrote into the copy, the shown value of a cell's last line),
with its folder as the working directory and the project's modules imported afresh from its copy, so
torch is imported once for all of them. A result: {"copy", "notebook", "printed" (what the cells printed),
"error" (None, or the failing cell's index, its first line and the error)}.
"""
import contextlib
import io
import json
import os
import sys

os.environ["MEDUSA_FAST"] = "1"  # tiny sizes: every notebook runs in seconds
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402,F401  (once, for every notebook)
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402


def forget(roots):
    """Drop the modules imported from these folders (a previous copy's core, lab, course and kit), and
    the folders from sys.path."""
    roots = [os.path.abspath(r) + os.sep for r in roots]
    for name, module in list(sys.modules.items()):
        path = os.path.abspath(getattr(module, "__file__", None) or os.sep)
        try:  # a namespace package (kit) has no file: its folders
            spots = [os.path.abspath(p) + os.sep for p in list(getattr(module, "__path__", None) or [])]
        except TypeError:
            spots = []
        if any(path.startswith(r) or any(s.startswith(r) for s in spots) for r in roots):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not any((os.path.abspath(p) + os.sep).startswith(r) for r in roots)]


def run(copy, name) -> dict:
    folder = os.path.join(copy, "notebooks")
    os.chdir(folder)
    sys.path.insert(0, folder)  # as a kernel started there has it
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance(colors="NoColor")  # a failing cell's traceback as plain text
    with open(name, encoding="utf-8") as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    printed, error = io.StringIO(), None
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            result = shell.run_cell(source, store_history=True)
        if not result.success:
            problem = result.error_in_exec or result.error_before_exec
            error = f"code cell {i} ({source.splitlines()[0] if source else ''}): {type(problem).__name__}: {problem}"
            break
    import matplotlib.pyplot as plt
    plt.close("all")
    return dict(copy=copy, notebook=name, printed=printed.getvalue(), error=error)


def main(argv):
    pairs = list(zip(argv[::2], argv[1::2]))
    results = []
    for copy, name in pairs:
        forget({c for c, _ in pairs})
        results.append(run(os.path.abspath(copy), name))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
