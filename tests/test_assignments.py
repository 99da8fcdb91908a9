"""The course assignment kit: assignments.toml, make_assignment.py and grade.py.

With only assignment N stubbed, the student version imports cleanly and fails exactly the tests
listed for N, each with N's own NotImplementedError; every other test in the graded test files
passes. Putting the original bodies back into each such version gives the project byte for byte;
graded as an instructor grades a submission (the full assignments.toml copied in), such a copy
passes every assignment. Handed out in sequence, the copy for N holds no reference body of N or of
any later assignment, and grades N on exactly the tests that do not need a later one. The copies
are made once and run two at a time: about 60 CPU-seconds."""
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grade  # noqa: E402
import grading  # noqa: E402
import make_assignment as ma  # noqa: E402

MAPPING = ma.load_mapping()
ASSIGNMENTS = list(MAPPING["assignment"])


def graded(n) -> list[str]:
    """The tests of assignment n, private ones included."""
    return MAPPING["assignment"][n]["tests"] + MAPPING["assignment"][n].get("private", [])


GRADED_FILES = sorted({t.split("::")[0] for n in ASSIGNMENTS for t in graded(n)})
PRIVATE = ROOT / ma.PRIVATE_DIR  # an instructor's private tests: put into every copy, as when grading
ENV = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # the graded tests use no plugins: 2 s less a run

# Run in a student version: import every module, then every test of the graded files (not only the
# assignment's own), results to suite.json.
RUN_SUITE = """
import importlib, json, pathlib, sys
for module in sorted(pathlib.Path('.').glob('*.py')):
    importlib.import_module(module.stem)
import grading
json.dump(grading.run_tests(sys.argv[1:]), open('suite.json', 'w'), indent=1)
"""

SECRET_TEST = '''"""An instructor's private test for assignment 2."""
import torch
from tree import build_tree_buffers, gather_paths


def test_gather_paths_reads_the_root_for_padding():
    b = build_tree_buffers([(0,), (1,), (0, 0)])
    assert gather_paths(torch.arange(4) * 10, b).tolist() == [[0, 10, 30], [0, 20, 0]]
'''


def restore_bodies(copy: Path, number):
    """What a student does, done with the original bodies: put them back into every stub."""
    for file, stubs in ma.stubs_by_file(MAPPING["assignment"][number]).items():
        original, source = ma.read_source(ROOT / file), ma.read_source(copy / file)
        for name, _ in stubs:
            source = ma.replace_body(source, name, ma.get_body(original, name))
        ma.write_source(copy / file, source)


def private_project(base: Path) -> Path:
    """A copy of the project (not a git checkout) with a private test, listed under a small assignment 2."""
    project = base / "project"
    for f in ma.project_files(ROOT):
        (project / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, project / f)
    (project / "tests/private").mkdir(exist_ok=True)
    (project / "tests/private/test_secret.py").write_text(SECRET_TEST)
    small = dict(MAPPING["assignment"]["2"], tests=["tests/test_tree.py::test_worked_example_dense_2x3"],
                 private=["tests/private/test_secret.py"])
    (project / ma.MAPPING).write_text(ma.student_mapping("2", small))
    return project


def run(cwd, *args):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    return proc, f"{proc.stdout}{proc.stderr}\n[{time.perf_counter() - start:.1f} s in {cwd}]"


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Every student version, stubbed and restored, and a project with private tests; the runs, two at a time."""
    base = tmp_path_factory.mktemp("kit")
    project_bytes = {f: (ROOT / f).read_bytes() for f in ma.project_files(ROOT)}  # before any copy
    jobs = {}  # name: (directory, python arguments), longest first
    for n in ASSIGNMENTS:
        ma.make_assignment(n, base / f"restored-{n}", in_sequence=False)
        restore_bodies(base / f"restored-{n}", n)
    # Graded as an instructor grades a submission: their mapping and private tests copied over it.
    restored = base / f"restored-{ASSIGNMENTS[0]}"
    shutil.copy2(ROOT / ma.MAPPING, restored / ma.MAPPING)
    jobs["restored"] = (restored, ["grade.py", "--json", "result.json"])
    for n in ASSIGNMENTS:
        ma.make_assignment(n, base / f"stubbed-{n}", in_sequence=False)
        jobs[f"stubbed-{n}"] = (base / f"stubbed-{n}", ["-c", RUN_SUITE, *GRADED_FILES])
    # Handed out in sequence: assignment 3 as the student gets it, and once they have done it.
    for name in ("in-sequence-3", "done-in-sequence-3"):
        ma.make_assignment("3", base / name)
        jobs[name] = (base / name, ["grade.py", "--json", "result.json"])
    restore_bodies(base / "done-in-sequence-3", "3")
    if PRIVATE.is_dir():
        for copy in [restored] + [base / f"stubbed-{n}" for n in ASSIGNMENTS]:
            shutil.copytree(PRIVATE, copy / ma.PRIVATE_DIR)
    project = private_project(base)
    for name in ("private-missing", "private-present"):
        ma.make_assignment("2", base / name, root=project, in_sequence=False)
        jobs[name] = (base / name, ["grade.py", "--json", "result.json"])
    shutil.copytree(project / "tests/private", base / "private-present/tests/private")  # as when grading
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, cwd, *args) for name, (cwd, args) in jobs.items()}
        return dict(base=base, project_bytes=project_bytes, **{name: f.result() for name, f in futures.items()})


def test_mapping_names_real_functions_once():
    """Every stub names a function of a project file, with a one-line hint; no function is in two assignments."""
    seen = {}
    for n, a in MAPPING["assignment"].items():
        assert a["title"] and a["stubs"] and a["tests"], f"assignment {n} needs a title, stubs and tests"
        for key, hint in a["stubs"].items():
            file, _, name = key.partition(":")
            assert name and (ROOT / file).is_file(), f"assignment {n}: {key!r} is not 'file:function'"
            ma.body_range(ma.read_source(ROOT / file), name)  # raises if there is no such function
            assert hint.strip() and "\n" not in hint, f"assignment {n}: the hint of {key} must be one line"
            assert key not in seen, f"{key} is in assignments {seen[key]} and {n}"
            seen[key] = n
        for p in a.get("private", []):
            assert p.startswith(ma.PRIVATE_DIR) and (ROOT / p.split("::")[0]).is_file(), p


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_student_version_fails_exactly_its_graded_tests(kit, n):
    """The copy imports; its graded tests fail with its own NotImplementedError; every other test passes."""
    copy, a = kit["base"] / f"stubbed-{n}", MAPPING["assignment"][n]
    proc, out = kit[f"stubbed-{n}"]
    assert proc.returncode == 0, out  # every module imported and the tests ran
    cases = json.loads((copy / "suite.json").read_text())
    for spec in graded(n):
        assert any(grading.matches(nodeid, spec) for nodeid in cases), f"no test {spec}"
    for nodeid, case in cases.items():
        assert not case["message"].startswith("not run:"), f"{nodeid}: {case['message']}"
        if any(grading.matches(nodeid, spec) for spec in graded(n)):
            assert f"NotImplementedError: Assignment {n}:" in case["message"], f"{nodeid}: {case}"
        else:
            assert case["outcome"] == "passed", f"{nodeid} fails but assignment {n} does not list it: {case}"

    for file, stubs in ma.stubs_by_file(a).items():  # each body is one raise with its hint
        source = ma.read_source(copy / file)
        for name, hint in stubs:
            assert ma.get_body(source, name) == [ma.stub_line(ma.body_range(source, name)[2], n, hint)]
    mapping = ma.load_mapping(copy / ma.MAPPING)
    assert mapping["default"] == n and mapping["assignment"] == {n: dict(a, private=a.get("private", []))}
    assert (copy / "ASSIGNMENT.md").read_text().startswith(f"# Assignment {n}: {a['title']}")
    for excluded in MAPPING["exclude"]:
        assert not (copy / excluded).exists()


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_original_bodies_give_back_the_project(kit, n):
    """Every file of the student version, its stubs filled with the original bodies, is the project's."""
    copy = kit["base"] / f"restored-{n}"
    files = [f for f in kit["project_bytes"] if not f.startswith(tuple(MAPPING["exclude"]))]
    secret = [line for lines in ma.solution_lines(ROOT, files, MAPPING["assignment"][n]["stubs"]).values()
              for line in lines]
    for f, original in kit["project_bytes"].items():
        if f != ma.MAPPING and not f.startswith((*MAPPING["exclude"], ma.PRIVATE_DIR)):
            if f.endswith(".ipynb"):  # outputs showing a stubbed function's source are cleared
                original = ma.clear_leaking_outputs(original.decode("utf-8"), secret).encode("utf-8")
            assert (copy / f).read_bytes() == original, f"{f} differs"


def test_restored_student_version_passes_every_assignment(kit):
    """grade.py in a restored copy: every graded test of every assignment passes, exit status 0."""
    proc, out = kit["restored"]
    assert proc.returncode == 0, out
    result = json.loads((kit["base"] / f"restored-{ASSIGNMENTS[0]}" / "result.json").read_text())
    assert result["passed"] and [r["assignment"] for r in result["assignments"]] == ASSIGNMENTS
    for r in result["assignments"]:
        assert [t["test"] for t in r["tests"]] == graded(r["assignment"])
        assert all(0 < t["passed"] == t["cases"] for t in r["tests"]), r
        k = len(r["tests"])
        assert f"Score: {k}/{k} tests pass" in proc.stdout
    assert f"{len(ASSIGNMENTS)}/{len(ASSIGNMENTS)} assignments pass" in proc.stdout


def test_private_tests_stay_out_of_student_versions_and_are_graded(kit):
    """tests/private/ is never copied; grade.py says so, and grades the private tests once they are put back."""
    missing, present = kit["base"] / "private-missing", kit["base"] / "private-present"
    assert not (missing / "tests/private").exists()
    proc, out = kit["private-missing"]
    assert proc.returncode == 1, out
    assert "FAIL" in proc.stdout and "1 private test(s) are not in this copy" in proc.stdout
    proc, out = kit["private-present"]
    assert proc.returncode == 1, out
    rows = json.loads((present / "result.json").read_text())["assignments"][0]["tests"]
    assert [r["private"] for r in rows] == [False, True]
    assert all(r["passed"] == 0 and "NotImplementedError: Assignment 2:" in r["message"] for r in rows), rows


def test_make_assignment_refuses_bad_directories_and_unknown_numbers(tmp_path, capsys):
    """A clear error and no half-written copy: a non-empty directory, one inside the project, a wrong number."""
    (tmp_path / "old.txt").write_text("keep me")
    assert ma.main(["1", "--out", str(tmp_path)]) == 2
    assert ma.main(["1", "--out", str(ROOT / "student-1")]) == 2  # the next copy would copy this one
    assert ma.main(["99", "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists() and not (ROOT / "student-1").exists()
    assert ma.main(["1"]) == 2 and ma.main(["1", "--out", str(tmp_path / "new"), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "under out/" in err and "no assignment '99'" in err and "--bogus" in err
    assert all(line.startswith("error: ") for line in err.splitlines()), err  # one line each, no traceback
    assert ma.main(["--list"]) == 0
    assert "Assignment 1:" in capsys.readouterr().out


@pytest.mark.parametrize("file", ["medusa_mini.py", "tree.py"])
def test_stubbing_any_function_and_restoring_it_gives_back_the_file(file):
    """The rewrite is local: stub every top-level function and method, one at a time, then put the body back."""
    source = ma.read_source(ROOT / file)
    module = ast.parse(source)
    names = [n.name for n in module.body if isinstance(n, ast.FunctionDef)]
    names += [f"{c.name}.{m.name}" for c in module.body if isinstance(c, ast.ClassDef)
              for m in c.body if isinstance(m, ast.FunctionDef)]
    assert len(names) > 10
    for name in names:
        stubbed = ma.stub_source(source, [(name, "hint")], 0)
        indent = ma.body_range(stubbed, name)[2]
        assert ma.get_body(stubbed, name) == [ma.stub_line(indent, 0, "hint")], name
        assert ma.replace_body(stubbed, name, ma.get_body(source, name)) == source, name


# ---------------------------------------------------------------- handed out in sequence

@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_a_copy_holds_no_solution_ahead_of_the_student(tmp_path, n):
    """The copy for N, as handed out: N's functions and every later assignment's are stubs; no line
    of their reference bodies (notebook outputs included) nor a later assignment's full hint is in any file."""
    copy = tmp_path / "copy"
    ma.make_assignment(n, copy)
    later = ma.later_assignments(MAPPING, n)
    texts = {f: p.read_text(encoding="utf-8", errors="replace") for p in copy.rglob("*") if p.is_file()
             for f in [p.relative_to(copy).as_posix()]}
    files = [f for f in ma.project_files(ROOT) if not f.startswith(tuple(MAPPING["exclude"]))]
    for m in [n] + later:
        secret = ma.solution_lines(ROOT, files, MAPPING["assignment"][m]["stubs"])
        assert sum(map(len, secret.values())) > 5, f"assignment {m}: too few lines of its own to look for: {secret}"
        for key, lines in secret.items():
            file, _, name = key.partition(":")
            hint = MAPPING["assignment"][m]["stubs"][key] if m == n else ma.later_hint(n)
            assert ma.get_body(texts[file], name) == [ma.stub_line(ma.body_range(texts[file], name)[2], m, hint)], \
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


def test_a_copy_in_sequence_grades_what_it_can_and_says_what_waits(kit):
    """grade.py in the copy for 3 as handed out: its own tests fail with its stubs, the end-to-end ones
    wait for assignment 4 (LATER); once 3 is done, the copy passes although 4 and 5 are still stubs."""
    graded_now = grading.graded_in_sequence(MAPPING["assignment"], "3")
    waits = [t for t in graded("3") if t not in graded_now]
    assert graded_now and waits
    for name, code in (("in-sequence-3", 1), ("done-in-sequence-3", 0)):
        proc, out = kit[name]
        assert proc.returncode == code, out
        result = json.loads((kit["base"] / name / "result.json").read_text())["assignments"]
        assert [r["assignment"] for r in result] == ["3"], out
        assert [r["test"] for r in result[0]["tests"]] == graded_now
        assert [(r["test"], r["waits_for"]) for r in result[0]["later"]] == [(t, "4") for t in waits]
        assert f"{len(waits)} more test(s) grade this assignment end to end" in proc.stdout
        for r in result[0]["tests"]:
            assert (r["passed"] == r["cases"] > 0) if code == 0 else "NotImplementedError: Assignment 3:" in r["message"]


def test_hints_in_two_levels(capsys):
    """The stub gives a one-line nudge; grade.py --hint NAME prints the full hint, whole, and says
    clearly (one line, exit 2) when there is no such function."""
    for n, a in MAPPING["assignment"].items():
        assert list(a["hints"]) == list(a["stubs"]), f"assignment {n}: one full hint per stub"
        for key, full in a["hints"].items():
            nudge = a["stubs"][key]
            assert len(nudge) <= 150 and len(full) > 2 * len(nudge), f"{key}: a short nudge, a longer hint"
            assert grade.main(["--hint", key]) == 0
            assert full.strip() in capsys.readouterr().out  # never cut
    assert grade.main(["--hint", "no_such_function"]) == 2
    assert grade.main(["99"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
