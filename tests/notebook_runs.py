"""Run notebooks top to bottom, one at a time, in one Python process: nbclient (what nbmake and
`jupyter nbconvert --execute` run on) starts a kernel for each, in the notebook's own folder, with this
process's environment. The test files start this as one subprocess for many notebooks, so Jupyter's
imports are paid once, not once a notebook.

    python tests/notebook_runs.py PLAN.json RESULTS.json [CELLS.json]

PLAN.json: {notebook path: where to write it executed, or null}. RESULTS.json, rewritten after each
notebook: {notebook path: "" when every cell ran, else the error}. Each cell may take 300 s.
CELLS.json, if given: {notebook path: per code cell, which of the functions that assignments stub it
entered (outside course.load and course.load_drafter) and the course.needs calls it made ({"entered":
[keys], "needs": [[numbers], ...]})}, noted by a cell run first in the same kernel (TRACE_CELLS) and left
out of the executed notebook."""
import json
import os
import sys
import tempfile

import nbformat
from nbclient import NotebookClient

import warm

TRACE_CELLS = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
import course, grading, noting
_noted = dict(cells=[], entered=set(), needs=[], started=False, quiet=0)
def _note(key):
    if not _noted["quiet"]:
        _noted["entered"].add(key)
noting.install([key for a in grading.load_mapping()["assignment"].values() for key in a["stubs"]], _note)
def _noting_needs(*numbers, needs=course.needs):
    _noted["needs"].append([int(n) for n in numbers])
    return needs(*numbers)
def _quiet(load):  # course.load and load_drafter choose what to build from the copy's stubs themselves
    def quiet(*args, **kwargs):
        _noted["quiet"] += 1
        try:
            return load(*args, **kwargs)
        finally:
            _noted["quiet"] -= 1
    return quiet
course.needs, course.load, course.load_drafter = _noting_needs, _quiet(course.load), _quiet(course.load_drafter)
def _pre_run_cell(info):
    _noted["entered"].clear(), _noted["needs"].clear()
    _noted["started"] = True
def _post_run_cell(result):
    if _noted["started"]:  # not this cell
        _noted["cells"].append(dict(entered=sorted(_noted["entered"]), needs=list(_noted["needs"])))
        with open({out!r}, "w") as f:
            json.dump(_noted["cells"], f)
get_ipython().events.register("pre_run_cell", _pre_run_cell)
get_ipython().events.register("post_run_cell", _post_run_cell)
"""


def run(plan: dict, results_path: str, cells_path=None) -> dict:
    results, kernel, traced = {}, {}, {}
    if os.environ.get(warm.SOCKET):  # started through tests/warm.py: so are the kernels
        folder = tempfile.mkdtemp(prefix="kernelspec-")
        kernel["kernel_name"] = warm.kernelspec(folder)
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("JUPYTER_PATH")]))
    for path, executed in plan.items():
        notebook = nbformat.read(path, as_version=4)
        if cells_path:
            out = f"{cells_path}.{len(traced)}"
            root = os.path.dirname(os.path.dirname(path))  # the project the notebook belongs to
            source = TRACE_CELLS.format(root=root, tests=os.path.join(root, "tests"), out=out)
            notebook.cells.insert(0, nbformat.v4.new_code_cell(source))
        client = NotebookClient(notebook, timeout=300, resources={"metadata": {"path": os.path.dirname(path)}},
                                **kernel)
        try:
            client.execute()
            results[path] = ""
        except Exception as e:  # a cell's error (with its traceback), a timeout, a kernel that died
            results[path] = f"{type(e).__name__}: {e}"
        if cells_path:
            notebook.cells.pop(0)
            traced[path] = json.load(open(out)) if os.path.exists(out) else []
            with open(cells_path, "w") as f:
                json.dump(traced, f, indent=1)
        if executed:
            os.makedirs(os.path.dirname(executed), exist_ok=True)
            nbformat.write(notebook, executed)
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    plan_path, results_path, *cells_path = sys.argv[1:]
    with open(plan_path) as f:
        run({os.path.abspath(p): e for p, e in json.load(f).items()}, results_path, *cells_path)
