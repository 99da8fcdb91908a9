"""The copies as they are handed out, in sequence (the copy for N also stubs every later assignment): what
runs there and what waits. In each, every command stops with one line naming the first assignment it
waits for, before it loads or trains anything (it writes nothing), and runs once what it needs is
written; a notebook that shows N's code runs top to bottom on the model the copy came with (out/tiny/),
its cells that need N saying so. grade.py in the copy for 3 grades what it can and says what waits; an
instructor's private tests stay out of copies and are graded when put back."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit_helpers import (ASSIGNMENTS, MAPPING, ROOT, assignments, copy_for, grade_in, grading, ma,
                         project_copy, reach_data)

import stubs  # noqa: E402

COMMANDS = [  # each command as a student runs it in a copy, with the drafters that change what it needs
    ("train_heads.py", "--preset", "tiny", "--drafters", "medusa,eagle", "--out", "out/try"),
    ("train_heads.py", "--preset", "tiny", "--out", "out/try"),
    ("sample.py", "--out", "out/try", "--drafter", "eagle"),
    ("sample.py", "--out", "out/try", "--prompt", "ROMEO:"),
    ("benchmark.py", "--out", "out/try"),
    ("ablation.py", "--out", "out/try"),
    ("export.py", "--out", "out/try", "--drafter", "medusa", "--format", "vllm", "--to", "out/try/export"),
]
NOTEBOOKS = {n: a["notebooks"] for n, a in MAPPING["assignment"].items()}


def needs(command) -> list[int]:
    """The assignments a command runs ([commands] and [drafters] of kit/assignments.toml)."""
    return stubs.needed(command[0], list(command[1:]), MAPPING)


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_each_command_stops_in_one_line_naming_what_it_waits_for(n):
    """In the copy for N, a command that needs an assignment from N on stops with exit status 1 and one line,
    `error: COMMAND needs assignment M (its functions still stubs)`, M the first it needs, having written
    nothing (its --out is not made)."""
    copy = copy_for(n)
    stubbed = {int(m) for m in ASSIGNMENTS if int(m) >= int(n)}
    for command in COMMANDS:
        waits = sorted(set(needs(command)) & stubbed)
        if not waits:
            continue
        proc = subprocess.run([sys.executable, *command], cwd=copy, capture_output=True, text=True, timeout=120)
        keys = [k for m, k, _ in stubs.stubs_in(root=copy) if m == waits[0]]
        assert (proc.returncode, proc.stderr.splitlines()) == (1, [f"error: {stubs.waiting_line(command[0], waits[0], keys)}"]), \
            (command, proc.stderr[-2000:])
        assert not proc.stdout and not (copy / "out" / "try").exists(), f"{command[0]} wrote in the copy for {n}"


def test_a_command_shows_its_help_in_every_copy_and_the_kit_knows_its_drafters():
    """In the first copy (every assignment a stub), a command asked for its help shows it: its stop lets
    -h and --help through. (That a command runs once what it needs is written, the stop's own test shows:
    kit/tests/test_kit_mapping.py.) The drafters it offers are those [drafters] of kit/assignments.toml
    names: a drafter added to the project must say there which assignments its code needs."""
    proc = subprocess.run([sys.executable, "sample.py", "--help"], cwd=copy_for(ASSIGNMENTS[0]), capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr
    offered = re.search(r"--drafter \{([\w,]+)\}", proc.stdout).group(1).split(",")
    assert set(offered) == set(MAPPING["drafters"]), f"sample.py offers drafters {offered}: list each in [drafters]"


def test_a_notebook_runs_in_each_copy_saying_what_waits():
    """In the copy for N, a notebook that shows N's code (the first kit/assignments.toml names under
    `notebooks`; the tests of the project run every notebook) runs top to bottom in fast mode, on the
    model the copy came with, a cell saying that it needs N (kit/tests/run_notebooks.py: one process for
    all)."""
    runs = [(n, NOTEBOOKS[n][0]) for n in ASSIGNMENTS]
    args = [str(a) for n, name in runs for a in (copy_for(n, models=True), name)]
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "run_notebooks.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    problems = [f"{name} in the copy for {n}: {r['error']}\n{r['printed'][-1500:]}"
                for (n, name), r in zip(runs, results) if r["error"]]
    assert not problems, "\n".join(problems)
    for (n, name), r in zip(runs, results):
        assert f"this cell needs assignment {n} (" in r["printed"], f"in the copy for {n}, no cell of {name} waited for it"


def test_a_copy_in_sequence_grades_what_it_can_and_says_what_waits(tmp_path):
    """grade.py in the copy for 3 as handed out: its own tests fail with its stubs, the end-to-end ones
    wait for assignment 4 (LATER); once 3 is done, the copy passes although 4 and 5 are still stubs."""
    every = assignments()
    graded_now = grading.graded_in_sequence(every, "3")
    waits = [t for t in every["3"]["tests"] if t not in graded_now]
    assert graded_now and waits and every["3"]["efficiency"]
    copy = tmp_path / "copy-3"
    ma.make_assignment("3", copy, models=False, reach=reach_data())
    done = Path(shutil.copytree(copy, tmp_path / "done-3"))
    ma.restore_bodies(done, MAPPING["assignment"]["3"])
    for folder, code in ((copy, 1), (done, 0)):
        proc, result = grade_in(folder)
        assert proc.returncode == code, proc.stdout[-3000:]
        assert [r["assignment"] for r in result] == ["3"]
        assert [r["test"] for r in result[0]["tests"]] == graded_now
        assert [(r["test"], r["waits_for"]) for r in result[0]["later"]] == [(t, "4") for t in waits]
        eff = result[0]["efficiency"]
        assert eff["tests"] == [] and [(r["test"], r["waits_for"]) for r in eff["later"]] == \
            [(t, "4") for t in every["3"]["efficiency"]]
        assert "efficiency: not measured yet: its tests need assignment 4" in proc.stdout
        assert f"{len(waits)} more test(s) grade this assignment end to end" in proc.stdout
        for r in result[0]["tests"]:
            assert (r["passed"] == r["cases"] > 0) if code == 0 else "NotImplementedError: assignment 3:" in r["message"]
    assert "tests/test_decoding.py::test_greedy_picks_the_first_longest_row" in (copy / "ASSIGNMENT.md").read_text()


SECRET_TEST = '''"""An instructor's private test for assignment 2."""
import torch
from tree import build_tree_buffers, gather_paths


def test_gather_paths_reads_the_root_for_padding():
    b = build_tree_buffers([(0,), (1,), (0, 0)])
    assert gather_paths(torch.arange(4) * 10, b).tolist() == [[0, 10, 30], [0, 20, 0]]
'''


def test_private_tests_stay_out_of_student_versions_and_are_graded(tmp_path):
    """tests/private/ is never copied; grade.py says so, and grades the private tests once they are put back.
    (An assignments.toml that lists its tests, as a copy's does, is taken as it is: no map is learned.)"""
    project = project_copy(tmp_path / "project")
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
