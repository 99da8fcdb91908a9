"""The notebooks in notebooks/ run top to bottom in fast mode, and import rather than redefine the code.

Each notebook runs through nbmake (the pytest plugin, pinned in requirements.txt) in its own pytest
process, with MEDUSA_FAST=1 in that process's environment, which the notebook's kernel inherits. So the
notebooks use the tiny model here even on a machine where `python train_heads.py` has written a real
out/heads.pt. The same run by hand: MEDUSA_FAST=1 python -m pytest --nbmake notebooks
"""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "[0-9]*.ipynb")))


def test_the_course_has_seven_numbered_notebooks():
    """notebooks/01_... to 07_...: the reading order in notebooks/README.md."""
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom_in_fast_mode(notebook):
    """Every cell runs without error, offline, on the tiny model (nbmake: 300 s per cell at most)."""
    env = dict(os.environ, MEDUSA_FAST="1")
    env.pop("MPLBACKEND", None)  # tests/conftest.py sets Agg; the kernel should use its inline backend
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=300", "-p", "no:cacheprovider", "-q",
         os.path.relpath(notebook, ROOT)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


FORBIDDEN = [r"class\s+\w+\s*\(.*nn\.Module", r"def\s+medusa_generate\b",
             r"def\s+(generate|tree_decoding|evaluate_posterior|build_tree_buffers|generate_candidates)\b"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_notebook_imports_the_model_and_decoding_code(notebook):
    """No notebook defines its own model, attention, tree buffers or decoding loop: they import medusa_mini and tree."""
    cells = json.load(open(notebook, encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "import medusa_mini" in code and "import tree" in code
    for pattern in FORBIDDEN:
        assert not re.search(pattern, code), f"{os.path.basename(notebook)} matches {pattern!r}"
