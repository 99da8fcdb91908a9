"""Each assignment's student copy, checked by running it: with assignment N's functions stubbed (and
nothing else), the graded test files fail in exactly the tests kit/assignments.toml lists for N, each with
N's own NotImplementedError, and every other test passes (kit/tests/README.md: the rule this keeps).
Putting the original bodies back gives the project byte for byte; graded in the project, every
assignment is correct and measures the reference's own ops per step."""
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "kit")]
import grading  # noqa: E402
import make_assignment as ma  # noqa: E402

MAPPING = ma.load_mapping(ROOT / ma.MAPPING)
ASSIGNMENTS = list(MAPPING["assignment"])


def graded(n) -> list[str]:
    """Every test of assignment n: correctness, private ones included, then efficiency."""
    a = MAPPING["assignment"][n]
    return a["tests"] + a.get("private", []) + a.get("efficiency", [])


GRADED_FILES = sorted({t.split("::")[0] for n in ASSIGNMENTS for t in graded(n)})
ENV = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the graded tests use no plugin


def run_pytest(folder, files) -> dict[str, str]:
    """`python -m pytest FILES` in a folder: {nodeid: "passed", or the failure's message}, from its JUnit XML."""
    xml = Path(folder) / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                           "-p", "no:unraisableexception", f"--junitxml={xml}", *files], cwd=folder, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        file = case.get("classname").replace(".", "/") + ".py"
        nodeid = f"{file}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcomes[nodeid] = "passed" if problem is None and case.find("skipped") is None else \
            "skipped" if problem is None else problem.get("message", "")
    return outcomes


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_a_copy_fails_exactly_the_tests_its_assignment_lists(n, tmp_path):
    """In the copy with only assignment N stubbed, a test fails exactly when N lists it, and with N's error;
    every other test passes there, as it does in the project (the rest of the suite runs them)."""
    copy = tmp_path / f"stubbed-{n}"
    ma.make_assignment(n, copy, in_sequence=False, models=False)
    got = run_pytest(copy, GRADED_FILES)
    assert len(got) > 100
    listed = {nodeid for nodeid in got if any(grading.matches(nodeid, spec) for spec in graded(n))}
    assert listed, f"assignment {n} lists no test of the graded files"
    for nodeid, outcome in got.items():
        if nodeid in listed:
            assert f"NotImplementedError: assignment {n}:" in outcome, (
                f"assignment {n} lists {nodeid}, which does not reach its functions: {outcome[:300]}")
        else:
            assert outcome in ("passed", "skipped"), (
                f"{nodeid} fails in the copy for {n} ({outcome[:300]}) but is not listed under assignment {n}: "
                f"list it (kit/tests/README.md)")


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_original_bodies_give_back_the_project(n, tmp_path):
    """Every file of the student version, its stubs filled with the original bodies, is the project's;
    the stubs' messages name the assignment (the marker commands read); the copy's mapping is its own."""
    copy = tmp_path / f"restored-{n}"
    files = ma.make_assignment(n, copy, in_sequence=False, models=False)
    a = MAPPING["assignment"][n]
    for file, stubs in ma.stubs_by_file(a).items():
        source = ma.read_source(copy / file)
        for name, hint in stubs:
            assert ma.get_body(source, name) == [ma.stub_line(ma.body_range(source, name)[2], n, name, hint)]
    ma.restore_bodies(copy, MAPPING["assignment"][n])
    project = [f for f in ma.project_files(ROOT) if not f.startswith((*MAPPING["exclude"], ma.PRIVATE_DIR))]
    secret = [line for lines in ma.solution_lines(ROOT, project, a["stubs"]).values() for line in lines]
    for f in project:
        if f == ma.MAPPING:
            continue
        original = (ROOT / f).read_bytes()
        if f.endswith(".ipynb"):  # outputs showing a stubbed function's source are cleared
            original = ma.clear_leaking_outputs(original.decode("utf-8"), secret).encode("utf-8")
        assert (copy / f).read_bytes() == original, f"{f} differs"
    mapping = ma.load_mapping(copy / ma.MAPPING)
    assert mapping["default"] == n and mapping["assignment"][n]["tests"] == a["tests"]
    assert (copy / "ASSIGNMENT.md").read_text().startswith(f"# Assignment {n}: {a['title']}")
    for excluded in MAPPING["exclude"]:
        assert not (copy / excluded).exists()
    assert set(files) >= {ma.MAPPING, "ASSIGNMENT.md"}


def test_graded_in_the_project_an_assignment_is_correct_at_the_reference_cost(tmp_path):
    """grade.py in a copy of the project (every assignment written), on assignment 4 cut to one of its
    correctness tests and its efficiency tests (those time a whole step): correct, exit status 0, and its
    efficiency line gives the reference's own figures, within bounds. (Every assignment's tests pass in
    the project: the rest of the suite runs them.)"""
    project = tmp_path / "project"
    for f in ma.project_files(ROOT):
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, project / f)
    a = MAPPING["assignment"]["4"]
    small = dict(a, tests=["tests/test_model.py::test_cache_keep_and_rollback"])
    (project / ma.MAPPING).write_text(ma.student_mapping("4", small))
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "kit/grade.py", "--json", str(out)], cwd=project, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and [r["assignment"] for r in result["assignments"]] == ["4"]
    r = result["assignments"][0]
    eff = r["efficiency"]
    assert r["correct"] and all(0 < t["passed"] == t["cases"] for t in r["tests"] + eff["tests"]), r
    assert [t["test"] for t in eff["tests"]] == a["efficiency"]
    assert f"efficiency: {eff['summary']}" in proc.stdout
    m = eff["measures"]
    assert f"{m['ops_per_step']:.1f}" == f"{m['reference_ops_per_step']:.1f}", (
        f"the reference counts {m['ops_per_step']:.2f} ops per step: update REFERENCE_OPS_PER_STEP in "
        f"tests/test_step_cost.py")
    assert "over" not in eff["summary"] and "host read per step" in eff["summary"], eff["summary"]


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_a_copy_holds_no_solution_ahead_of_the_student(tmp_path, n):
    """The copy for N, as handed out: N's functions and every later assignment's are stubs; no line
    of their reference bodies (notebook outputs included) nor a later assignment's full hint is in any text
    file (checkpoints, plots and token arrays are binary)."""
    copy = tmp_path / "copy"
    ma.make_assignment(n, copy, models=False)
    later = ma.later_assignments(MAPPING, n)
    texts = {}
    for p in copy.rglob("*"):
        if p.is_file():
            try:
                texts[p.relative_to(copy).as_posix()] = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                assert p.suffix in (".pt", ".png", ".npy"), f"{p}: neither text nor a checkpoint, plot or token array"
    files = [f for f in ma.project_files(ROOT) if not f.startswith(tuple(MAPPING["exclude"]))]
    for m in [n] + later:
        secret = ma.solution_lines(ROOT, files, MAPPING["assignment"][m]["stubs"])
        assert sum(map(len, secret.values())) > 5, f"assignment {m}: too few lines of its own to look for: {secret}"
        for key, lines in secret.items():
            file, _, name = key.partition(":")
            hint = MAPPING["assignment"][m]["stubs"][key] if m == n else ma.later_hint(n)
            assert ma.get_body(texts[file], name) == [ma.stub_line(ma.body_range(texts[file], name)[2], m, name, hint)], \
                f"copy for {n}: {key} (assignment {m}) is not a stub"
            for line in lines:
                where = [f for f, t in texts.items() if line in t]
                assert not where, f"copy for {n}: {where[0]} holds {line!r} from the body of {key} (assignment {m})"
        for key, full in MAPPING["assignment"][m].get("hints", {}).items():
            if m != n:
                assert not any(full.strip()[:80] in t for t in texts.values()), f"copy for {n} holds the hint of {key}"
    mapping = ma.load_mapping(copy / ma.MAPPING)
    assert mapping["default"] == n and list(mapping["assignment"]) == [n] + later
    assert mapping["assignment"][n]["hints"] == MAPPING["assignment"][n]["hints"]
    assert all("hints" not in mapping["assignment"][m] for m in later)
