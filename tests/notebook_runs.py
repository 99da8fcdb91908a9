"""Run notebooks top to bottom, one at a time, in one Python process: nbclient (what nbmake and
`jupyter nbconvert --execute` run on) starts a kernel for each, in the notebook's own folder, with this
process's environment. The test files start this as one subprocess for many notebooks, so Jupyter's
imports are paid once, not once a notebook.

    python tests/notebook_runs.py PLAN.json RESULTS.json

PLAN.json: {notebook path: where to write it executed, or null}. RESULTS.json, rewritten after each
notebook: {notebook path: "" when every cell ran, else the error}. Each cell may take 300 s."""
import json
import os
import sys
import tempfile

import nbformat
from nbclient import NotebookClient

import warm


def run(plan: dict, results_path: str) -> dict:
    results, kernel = {}, {}
    if os.environ.get(warm.SOCKET):  # started through tests/warm.py: so are the kernels
        folder = tempfile.mkdtemp(prefix="kernelspec-")
        kernel["kernel_name"] = warm.kernelspec(folder)
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("JUPYTER_PATH")]))
    for path, executed in plan.items():
        notebook = nbformat.read(path, as_version=4)
        client = NotebookClient(notebook, timeout=300, resources={"metadata": {"path": os.path.dirname(path)}},
                                **kernel)
        try:
            client.execute()
            results[path] = ""
        except Exception as e:  # a cell's error (with its traceback), a timeout, a kernel that died
            results[path] = f"{type(e).__name__}: {e}"
        if executed:
            os.makedirs(os.path.dirname(executed), exist_ok=True)
            nbformat.write(notebook, executed)
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    plan_path, results_path = sys.argv[1:]
    with open(plan_path) as f:
        run({os.path.abspath(p): e for p, e in json.load(f).items()}, results_path)
