"""The copies as they are handed out, in sequence (the copy for N also stubs every later assignment): what
runs there and what waits. In each: every module imports; the commands stop before doing anything, within
5 seconds, with one line naming the assignment they wait for; the notebooks that show N's code run top to
bottom on the model the copy came with (out/tiny/), their cells that need N saying so. grade.py in the
copy for 3 grades what it can and says what waits; an instructor's private tests stay out of copies
and are graded when put back."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "kit")]
import grading  # noqa: E402
import make_assignment as ma  # noqa: E402

MAPPING = ma.load_mapping(ROOT / ma.MAPPING)
ASSIGNMENTS = list(MAPPING["assignment"])
EVERY = [int(n) for n in ASSIGNMENTS]
COMMANDS = {  # a command, and the assignments whose code it runs (sample.py decodes: it grows no tree)
    ("train_heads.py", "--preset", "tiny", "--drafters", "medusa,eagle", "--out", "out/try"): EVERY,
    ("sample.py", "--out", "out/tiny", "--drafter", "eagle"): [n for n in EVERY if n != 5],
    ("benchmark.py", "--out", "out/tiny"): EVERY, ("ablation.py", "--out", "out/tiny"): EVERY}


def notebooks_teaching() -> dict[str, list[str]]:
    """{assignment: the notebooks that show its code}, from notebooks/README.md's table ("(assignment N)")."""
    rows = re.findall(r"^\| `(\d\d_\w+\.ipynb)` \|([^\n]*)", (ROOT / "notebooks/README.md").read_text(), re.M)
    teach = {}
    for name, row in rows:
        found = re.search(r"\(assignments? ([\d, ]+)\)", row)
        for n in found.group(1).replace(" ", "").split(",") if found else []:
            teach.setdefault(n, []).append(name)
    return teach


TEACHING = notebooks_teaching()
UNTAUGHT = sorted({p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")}
                  - {name for names in TEACHING.values() for name in names})  # run in the first copy


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The copy for each assignment, handed out in sequence, with the instructor's trained tiny run."""
    base = tmp_path_factory.mktemp("sequence")
    for n in ASSIGNMENTS:
        ma.make_assignment(n, base / n)
    return base


def run_notebook(path: Path) -> str:
    """Execute a notebook in its folder, in fast mode (nbclient, what nbmake and nbconvert run on): its
    printed text, or an AssertionError naming the failing cell."""
    notebook = nbformat.read(path, as_version=4)
    os.environ["MEDUSA_FAST"] = "1"  # the kernel inherits this process's environment
    try:
        NotebookClient(notebook, timeout=300, resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.pop("MEDUSA_FAST")
    return "".join("".join(o.get("text", "")) for c in notebook.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_each_copy_runs_what_it_can_and_names_what_it_waits_for(copies, n):
    """In the copy for N: the commands stop with one line naming the first assignment from N on whose code
    they run, within 5 seconds, having written nothing; the notebooks that show N's code (notebooks/README.md) run
    top to bottom, a cell that needs N saying so; in the first copy, the notebooks that show no
    assignment's code run too."""
    copy = copies / n
    for command, needs in COMMANDS.items():
        first = min(m for m in needs if m >= int(n))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *command], cwd=copy, capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - start
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (command, proc.stderr[-2000:])
        assert lines[0].startswith(f"error: {command[0]} needs assignment {first} ("), (command, lines[0])
        assert seconds < 5, f"{command[0]} took {seconds:.1f} s to stop in the copy for {n}"
    assert not (copy / "out" / "try").exists()
    assert TEACHING.get(n), f"notebooks/README.md names no notebook showing assignment {n}'s code"
    for name in sorted(TEACHING[n] + (UNTAUGHT if n == ASSIGNMENTS[0] else [])):
        printed = run_notebook(copy / "notebooks" / name)
        if name in TEACHING[n]:
            assert f"this cell needs assignment {n} (" in printed, f"in the copy for {n}, no cell of {name} waited for it"


def test_every_module_imports_in_the_copy_that_stubs_everything(copies):
    code = "import importlib, pathlib\nfor m in sorted(pathlib.Path('.').glob('*.py')): importlib.import_module(m.stem)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=copies / ASSIGNMENTS[0], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def grade_in(copy) -> tuple:
    proc = subprocess.run([sys.executable, "kit/grade.py", "--json", "result.json"], cwd=copy, capture_output=True,
                          text=True, timeout=600)
    return proc, json.loads((copy / "result.json").read_text())["assignments"]


def test_a_copy_in_sequence_grades_what_it_can_and_says_what_waits(copies, tmp_path):
    """grade.py in the copy for 3 as handed out: its own tests fail with its stubs, the end-to-end ones
    wait for assignment 4 (LATER); once 3 is done, the copy passes although 4 and 5 are still stubs."""
    a = MAPPING["assignment"]
    graded_now = grading.graded_in_sequence(a, "3")
    waits = [t for t in a["3"]["tests"] if t not in graded_now]
    assert graded_now and waits and a["3"]["efficiency"]
    done = Path(shutil.copytree(copies / "3", tmp_path / "done-3"))
    ma.restore_bodies(done, MAPPING["assignment"]["3"])
    for copy, code in ((copies / "3", 1), (done, 0)):
        proc, result = grade_in(copy)
        assert proc.returncode == code, proc.stdout[-3000:]
        assert [r["assignment"] for r in result] == ["3"]
        assert [r["test"] for r in result[0]["tests"]] == graded_now
        assert [(r["test"], r["waits_for"]) for r in result[0]["later"]] == [(t, "4") for t in waits]
        eff = result[0]["efficiency"]
        assert eff["tests"] == [] and [(r["test"], r["waits_for"]) for r in eff["later"]] == \
            [(t, "4") for t in a["3"]["efficiency"]]
        assert "efficiency: not measured yet: its tests need assignment 4" in proc.stdout
        assert f"{len(waits)} more test(s) grade this assignment end to end" in proc.stdout
        for r in result[0]["tests"]:
            assert (r["passed"] == r["cases"] > 0) if code == 0 else "NotImplementedError: assignment 3:" in r["message"]


SECRET_TEST = '''"""An instructor's private test for assignment 2."""
import torch
from tree import build_tree_buffers, gather_paths


def test_gather_paths_reads_the_root_for_padding():
    b = build_tree_buffers([(0,), (1,), (0, 0)])
    assert gather_paths(torch.arange(4) * 10, b).tolist() == [[0, 10, 30], [0, 20, 0]]
'''


def test_private_tests_stay_out_of_student_versions_and_are_graded(tmp_path):
    """tests/private/ is never copied; grade.py says so, and grades the private tests once they are put back."""
    project = tmp_path / "project"
    for f in ma.project_files(ROOT):
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, project / f)
    (project / "tests/private").mkdir()
    (project / "tests/private/test_secret.py").write_text(SECRET_TEST)
    small = dict(MAPPING["assignment"]["2"], tests=["tests/test_tree.py::test_worked_example_dense_2x3"],
                 private=["tests/private/test_secret.py"])
    (project / ma.MAPPING).write_text(ma.student_mapping("2", small))
    missing, present = tmp_path / "missing", tmp_path / "present"
    for copy in (missing, present):
        ma.make_assignment("2", copy, root=project, in_sequence=False, models=False)
    assert not (missing / "tests/private").exists()
    shutil.copytree(project / "tests/private", present / "tests/private")  # as when grading
    proc, _ = grade_in(missing)
    assert proc.returncode == 1 and "1 private test(s) are not in this copy" in proc.stdout, proc.stdout
    proc, result = grade_in(present)
    rows = result[0]["tests"]
    assert proc.returncode == 1 and [r["private"] for r in rows] == [False, True]
    assert all(r["passed"] == 0 and "NotImplementedError: assignment 2:" in r["message"] for r in rows), rows
