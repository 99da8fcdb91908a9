"""The course assignment kit: assignments.toml, make_assignment.py and grade.py.

With only assignment N stubbed, the student version imports cleanly and fails exactly the tests
listed for N (correctness and efficiency), each with N's own NotImplementedError; every other test
in the graded test files passes, because it never enters N's functions (one traced run, in a copy
with nothing stubbed, which then runs N's tests with N's stubs planted). Putting the original bodies back into each such version gives the
project byte for byte; graded as an instructor grades a submission (the full assignments.toml
copied in), such a copy passes every assignment, and measures the reference's own ops per step.
Handed out in sequence, the copy for N holds no reference body of N or of any later assignment, and
grades N on exactly the tests that do not need a later one. A correct but slower implementation is
correct (exit status 0) and reported over the bound. The copies are made once and run one at a
time: the slowest file of the suite."""
import ast
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grade  # noqa: E402
import grading  # noqa: E402
import common  # noqa: E402
import make_assignment as ma  # noqa: E402
import warm  # noqa: E402
from conftest import train_tiny_run  # noqa: E402

MAPPING = ma.load_mapping()
ASSIGNMENTS = list(MAPPING["assignment"])


def correctness(n) -> list[str]:
    """The correctness tests of assignment n, private ones included: they decide its exit status."""
    return MAPPING["assignment"][n]["tests"] + MAPPING["assignment"][n].get("private", [])


def efficiency(n) -> list[str]:
    """The efficiency tests of assignment n: run and reported, never failed."""
    return MAPPING["assignment"][n].get("efficiency", [])


def graded(n) -> list[str]:
    """Every test of assignment n: correctness, private ones included, then efficiency."""
    return correctness(n) + efficiency(n)


GRADED_FILES = sorted({t.split("::")[0] for n in ASSIGNMENTS for t in graded(n)})
STUBS = {key: n for n in ASSIGNMENTS for key in MAPPING["assignment"][n]["stubs"]}  # "file:function": assignment
PRIVATE = ROOT / ma.PRIVATE_DIR  # an instructor's private tests: put into every copy, as when grading
ENV = dict(os.environ, **common.FAST_MALLOC)  # set: train_heads.py starts once, not twice (grading.run_tests
                                              # loads no pytest plugin itself)

# Run in the copy handed out for the first assignment, where every assignment is stubbed: every module imports.
IMPORT_ALL = """
import importlib, pathlib
for module in sorted(pathlib.Path('.').glob('*.py')):
    importlib.import_module(module.stem)
"""

# Run in a restored copy (nothing stubbed), graded as an instructor grades a submission: grade.py's main
# (result.json, its output on stdout, its exit status), then the graded files' tests no assignment lists,
# noting which of the functions that assignments stub ("file:Class.method") each test enters: in its own
# setup, call and teardown, in the setup of every fixture it uses (a fixture built for an earlier test is
# still its own), and in the training behind every memoised model it receives. The project's functools
# caches are emptied before each test, so a test builds its own tree buffers. A test that enters none of
# assignment N's functions runs in N's stubbed copy exactly as here. Then, per assignment N, its graded
# tests with N's functions stubbed as in N's copy (each body the copy's one raise, planted as grade.py
# --mutants plants a fault), memoised models whose training entered N's functions trained again.
# argv[1]: plan.json, {"stubs": {key: N}, "bodies": {N: {key: its raise}}, "graded": {N: [tests]}}.
# To traced.json: {"cases": {nodeid: outcome}, "entered": {nodeid: [stub keys]}, "outside": [keys
# entered outside a test], "stubbed": {N: run_tests' results}}.
TRACE_SUITE = r"""
import contextlib, importlib, json, pathlib, sys
sys.path.insert(0, 'tests')
import memo, noting, pytest, grade, grading
for module in sorted(pathlib.Path('.').glob('*.py')):
    importlib.import_module(module.stem)
plan = json.load(open(sys.argv[1]))
entered, building = set(), []  # since the current test (or fixture) began; memoised trainings under way


def note(keys):
    entered.update(keys)
    for outer in building:
        outer.update(keys)


noting.install(plan['stubs'], lambda key: note({key}))


class Remembering(dict):  # memo's store of trained models, keeping what each training entered
    entered_by = {}

    def __contains__(self, key):
        if dict.__contains__(self, key):
            note(self.entered_by[key])
            return True
        building.append(set())
        return False

    def __setitem__(self, key, model):
        self.entered_by[key] = building.pop()
        dict.__setitem__(self, key, model)


memo._MODELS = Remembering()


class Attribute:
    def __init__(self):
        self.fixtures, self.tests, self.outside, self.outcomes = {}, {}, set(), {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items[:] = [item for item in items if item.nodeid not in self.tests]  # graded already

    def pytest_runtest_logreport(self, report):
        if self.outcomes.get(report.nodeid, 'passed') == 'passed':
            self.outcomes[report.nodeid] = report.outcome

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        outer = set(entered)
        entered.clear()
        yield
        self.fixtures[id(fixturedef), getattr(request, 'param_index', 0)] = set(entered)
        entered.update(outer)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.outside |= entered
        entered.clear()
        grading._clear_caches()
        yield
        keys = set(entered)
        indices = getattr(getattr(item, 'callspec', None), 'indices', {})
        for name in item.fixturenames:
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                keys |= self.fixtures.get((id(fixturedef), indices.get(name, 0)), set())
        self.tests[item.nodeid] = sorted(keys)
        entered.clear()


attribute, run = Attribute(), pytest.main
pytest.main = lambda args, plugins: run(args, plugins=[*plugins, attribute])
status = grade.main(['--json', 'result.json'])
grading.run_tests(sys.argv[2:])
outside = sorted(attribute.outside | entered)
pytest.main = run
stubbed = {}
for n, bodies in plan['bodies'].items():
    for key, keys in list(memo._MODELS.entered_by.items()):
        if any(plan['stubs'][k] == n for k in keys):
            dict.pop(memo._MODELS, key)
            del memo._MODELS.entered_by[key]
    with contextlib.ExitStack() as stack:
        for key, body in bodies.items():
            stack.enter_context(grading.planted(dict(name=f'the stub of {key}', function=key, body=body)))
        stubbed[n] = grading.run_tests(plan['graded'][n])
json.dump(dict(cases=attribute.outcomes, entered=attribute.tests, outside=outside, stubbed=stubbed),
          open('traced.json', 'w'), indent=1)
sys.exit(status)
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


SLOWER = next(e for e in grading.load_mutants(MAPPING["assignment"])["equivalent"] if e.get("slower"))


def slower_project(base: Path) -> Path:
    """Assignment 3 done right but slower (mutants.toml's slower evaluate_posterior written into verify.py),
    graded on its acceptance tests and its efficiency tests."""
    copy = base / "slower-3"
    ma.make_assignment("3", copy, in_sequence=False)
    restore_bodies(copy, "3")
    file = SLOWER["function"].partition(":")[0]
    source = ma.read_source(copy / file)
    assert source.count(SLOWER["replace"]) == 1, f"{SLOWER['name']}: its snippet is not once in {file}"
    ma.write_source(copy / file, source.replace(SLOWER["replace"], SLOWER["with"]))
    a = MAPPING["assignment"]["3"]
    small = dict(a, tests=grading.graded_in_sequence(MAPPING["assignment"], "3"), efficiency=a["efficiency"])
    (copy / ma.MAPPING).write_text(ma.student_mapping("3", small))
    return copy


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
# The notebooks that show no assignment's code: they run in the copy for the first assignment, where the
# most is stubbed.
UNTAUGHT = sorted({os.path.basename(p) for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")}
                  - {name for names in TEACHING.values() for name in names})


def shown_in_copy(n) -> list[str]:
    """The notebooks run in the copy for assignment n: those that show n's code, and in the first copy the
    notebooks that show none."""
    return sorted(TEACHING.get(n, []) + (UNTAUGHT if n == ASSIGNMENTS[0] else []))


def run(cwd, *args):
    start = time.perf_counter()
    env = dict(ENV, MEDUSA_FAST="1") if "notebooks.json" in args else ENV
    proc = warm.run(args, cwd, env, timeout=600)
    return proc, f"{proc.stdout}{proc.stderr}\n[{time.perf_counter() - start:.1f} s in {cwd}]"


def read_traced(kit) -> dict:
    """What the traced run in the restored copy wrote (TRACE_SUITE)."""
    proc, out = kit["restored"]
    path = kit["base"] / f"restored-{ASSIGNMENTS[0]}" / "traced.json"
    assert path.exists(), out[-3000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Every student version, stubbed and restored, and a project with private tests; the runs, one at a
    time (the other pytest worker keeps the second core busy: a third process slows them all)."""
    base = tmp_path_factory.mktemp("kit")
    train_tiny_run()  # the model every copy carries (make_assignment.py), if it is not trained yet
    project_bytes = {f: (ROOT / f).read_bytes() for f in ma.project_files(ROOT)}  # before any copy
    jobs = {}  # name: (directory, python arguments), longest first
    for n in ASSIGNMENTS:
        ma.make_assignment(n, base / f"restored-{n}", in_sequence=False)
        restore_bodies(base / f"restored-{n}", n)
    # Graded as an instructor grades a submission (their mapping and private tests copied over it), and
    # every other test of the graded files, traced; in the copy for N, N's tests.
    restored = base / f"restored-{ASSIGNMENTS[0]}"
    shutil.copy2(ROOT / ma.MAPPING, restored / ma.MAPPING)
    plan = dict(stubs=STUBS, graded={n: graded(n) for n in ASSIGNMENTS},
                bodies={n: {key: ma.stub_line("", n, hint) for key, hint in MAPPING["assignment"][n]["stubs"].items()}
                        for n in ASSIGNMENTS})
    (restored / "plan.json").write_text(json.dumps(plan))
    jobs["restored"] = (restored, ["-c", TRACE_SUITE, "plan.json", *GRADED_FILES])
    for n in ASSIGNMENTS:
        ma.make_assignment(n, base / f"stubbed-{n}", in_sequence=False)
    # Handed out in sequence: assignment 3 as the student gets it, and once they have done it.
    for name in ("in-sequence-3", "done-in-sequence-3"):
        ma.make_assignment("3", base / name)
        jobs[name] = (base / name, ["grade.py", "--json", "result.json"])
    restore_bodies(base / "done-in-sequence-3", "3")
    # Every copy handed out in sequence: what runs there and what stops, naming the assignment it waits for.
    notebooks = {}  # in each copy, the notebooks that show its assignment's code, on the model it came with
    for n in ASSIGNMENTS:
        copy = base / f"in-sequence-{n}"
        if not copy.exists():
            ma.make_assignment(n, copy)
        jobs[f"pipeline-{n}"] = (copy, ["train_heads.py", "--preset", "tiny", "--drafters", "medusa,eagle",
                                         "--out", "out/try"])
        notebooks.update({str(copy / "notebooks" / name): str(base / f"executed-{n}" / name) for name in shown_in_copy(n)})
    (base / "notebooks.json").write_text(json.dumps(notebooks))
    jobs["notebooks"] = (base, [str(ROOT / "tests" / "notebook_runs.py"), "notebooks.json", "ran.json"])
    jobs["imports"] = (base / f"in-sequence-{ASSIGNMENTS[0]}", ["-c", IMPORT_ALL])  # every function stubbed
    if PRIVATE.is_dir():  # the stubbed copies run no tests: their assignments' tests run in the restored one
        shutil.copytree(PRIVATE, restored / ma.PRIVATE_DIR)
    jobs["slower-3"] = (slower_project(base), ["grade.py", "--json", "result.json"])
    project = private_project(base)
    for name in ("private-missing", "private-present"):
        ma.make_assignment("2", base / name, root=project, in_sequence=False, models=False)
        jobs[name] = (base / name, ["grade.py", "--json", "result.json"])
    shutil.copytree(project / "tests/private", base / "private-present/tests/private")  # as when grading
    return dict(base=base, project_bytes=project_bytes, **{name: run(cwd, *args) for name, (cwd, args) in jobs.items()})


def test_mapping_names_real_functions_once():
    """Every stub names a function of a project file, with a one-line hint; no function is in two
    assignments; a test is correctness or efficiency, never both."""
    seen = {}
    every_efficiency = {t for n in ASSIGNMENTS for t in efficiency(n)}
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
        both = [t for t in correctness(n) if grading.is_efficiency_test(MAPPING["assignment"], t)]
        assert not both, f"assignment {n}: {both[0]} is a correctness test here and an efficiency test elsewhere"
    assert every_efficiency, "no efficiency tests: tests/test_step_cost.py's bounds are efficiency"


def test_every_graded_test_passes_and_enters_the_functions_of_exactly_the_assignments_listing_it(kit):
    """In a copy with nothing stubbed, every test of the graded files passes; a test listed under
    assignment N enters one of N's functions, and a test N does not list enters none of them, so it
    runs in N's stubbed copy exactly as here (the stubs change nothing else). Nothing enters them
    while the test files are collected."""
    for file in GRADED_FILES:  # a fixture fetched by name at run time would escape the noting
        assert "getfixturevalue" not in (ROOT / file).read_text(), f"{file}: request fixtures as arguments"
    traced = read_traced(kit)
    assert not traced["outside"], f"entered outside any test: {traced['outside']}"
    assert len(traced["cases"]) > 100 and traced["entered"].keys() == traced["cases"].keys()
    for nodeid, case in traced["cases"].items():
        assert case == "passed", f"{nodeid}: {case}"
        entered = {STUBS[key] for key in traced["entered"][nodeid]}
        listed = {n for n in ASSIGNMENTS if any(grading.matches(nodeid, spec) for spec in graded(n))}
        for n in sorted(listed - entered):
            raise AssertionError(f"assignment {n} lists {nodeid}, which enters none of its functions")
        for n in sorted(entered - listed):
            raise AssertionError(f"{nodeid} enters {[k for k in traced['entered'][nodeid] if STUBS[k] == n]} "
                                 f"(assignment {n}), which does not list it: it fails in that copy")


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_student_version_fails_exactly_its_graded_tests(kit, n):
    """With N's functions stubbed, each of N's graded tests fails with N's own NotImplementedError (run
    with the copy's stubs planted into the project; every other test passes there: the test above). The
    copy is the project with those bodies replaced; it imports, as even the copy that stubs every
    assignment does."""
    copy, a = kit["base"] / f"stubbed-{n}", MAPPING["assignment"][n]
    proc, out = kit["imports"]
    assert proc.returncode == 0, out
    traced = read_traced(kit)
    cases = traced["stubbed"][n]
    assert cases.keys() == {nodeid for nodeid in traced["cases"] if any(grading.matches(nodeid, s) for s in graded(n))}
    for nodeid, case in cases.items():
        assert f"NotImplementedError: Assignment {n}:" in case["message"], f"{nodeid}: {case}"

    for file, stubs in ma.stubs_by_file(a).items():  # each body is one raise with its hint
        source = ma.read_source(copy / file)
        for name, hint in stubs:
            assert ma.get_body(source, name) == [ma.stub_line(ma.body_range(source, name)[2], n, hint)]
    mapping = ma.load_mapping(copy / ma.MAPPING)
    assert mapping["default"] == n
    assert mapping["assignment"] == {n: dict(a, private=a.get("private", []), efficiency=efficiency(n))}
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
    """grade.py's main in a restored copy (under the trace above): every test of every assignment passes,
    exit status 0; each assignment is correct, and its efficiency line gives the reference's own figures,
    within bounds."""
    proc, out = kit["restored"]
    assert proc.returncode == 0, out
    result = json.loads((kit["base"] / f"restored-{ASSIGNMENTS[0]}" / "result.json").read_text())
    assert result["passed"] and [r["assignment"] for r in result["assignments"]] == ASSIGNMENTS
    for r in result["assignments"]:
        n, eff = r["assignment"], r["efficiency"]
        assert [t["test"] for t in r["tests"]] == correctness(n)
        assert [t["test"] for t in eff["tests"]] == efficiency(n)
        assert all(0 < t["passed"] == t["cases"] for t in r["tests"] + eff["tests"]), r
        assert r["correct"] and r["passed"]
        k = len(r["tests"])
        assert f"correct: yes ({k}/{k} tests pass" in proc.stdout
        assert f"efficiency: {eff['summary']}" in proc.stdout
        if efficiency(n):
            m = eff["measures"]
            assert f"{m['ops_per_step']:.1f}" == f"{m['reference_ops_per_step']:.1f}", (
                f"the reference counts {m['ops_per_step']:.2f} ops per step: "
                "update REFERENCE_OPS_PER_STEP in tests/test_step_cost.py")
            assert "over" not in eff["summary"] and "host read per step" in eff["summary"], eff["summary"]
    assert f"{len(ASSIGNMENTS)}/{len(ASSIGNMENTS)} assignments pass" in proc.stdout


def test_a_correct_but_slower_step_passes_and_is_reported_slower(kit):
    """grade.py on assignment 3 done right but with 3 ops more a step than the reference (past the ops
    bound): correct, exit status 0; the efficiency test is OVER and the efficiency line says by how much."""
    proc, out = kit["slower-3"]
    assert proc.returncode == 0, out
    [r] = json.loads((kit["base"] / "slower-3" / "result.json").read_text())["assignments"]
    assert r["correct"] and all(0 < t["passed"] == t["cases"] for t in r["tests"]), out
    m = r["efficiency"]["measures"]
    assert m["ops_per_step"] > m["reference_ops_per_step"] and m["ops_ratio"] > m["ops_ratio_bound"], m
    assert m["host_reads_per_step"] <= m["host_reads_bound"], m
    assert "correct: yes" in proc.stdout and "(bound 1.30: over)" in proc.stdout, out
    assert re.search(r"OVER +0/1 +tests/test_step_cost.py::test_a_step_launches", proc.stdout), out


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
    of their reference bodies (notebook outputs included) nor a later assignment's full hint is in any text
    file (the checkpoints, plots and token arrays are binary)."""
    copy = tmp_path / "copy"
    ma.make_assignment(n, copy)
    later = ma.later_assignments(MAPPING, n)
    texts = {}
    for p in copy.rglob("*"):
        try:
            texts[p.relative_to(copy).as_posix()] = p.read_bytes().decode("utf-8") if p.is_file() else None
        except UnicodeDecodeError:
            assert p.suffix in (".pt", ".png", ".npy"), f"{p}: neither text nor a checkpoint, plot or token array"
    texts = {f: t for f, t in texts.items() if t is not None}
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
    waits = [t for t in correctness("3") if t not in graded_now]
    assert graded_now and waits and efficiency("3")
    assert grading.graded_in_sequence(MAPPING["assignment"], "3", "efficiency") == []  # a step needs 4
    for name, code in (("in-sequence-3", 1), ("done-in-sequence-3", 0)):
        proc, out = kit[name]
        assert proc.returncode == code, out
        result = json.loads((kit["base"] / name / "result.json").read_text())["assignments"]
        assert [r["assignment"] for r in result] == ["3"], out
        assert [r["test"] for r in result[0]["tests"]] == graded_now
        assert [(r["test"], r["waits_for"]) for r in result[0]["later"]] == [(t, "4") for t in waits]
        eff = result[0]["efficiency"]
        assert eff["tests"] == [], out
        assert [(r["test"], r["waits_for"]) for r in eff["later"]] == [(t, "4") for t in efficiency("3")]
        assert "efficiency: not measured yet: its tests need assignment 4" in proc.stdout, out
        assert f"{len(waits)} more test(s) grade this assignment end to end" in proc.stdout
        for r in result[0]["tests"]:
            assert (r["passed"] == r["cases"] > 0) if code == 0 else "NotImplementedError: Assignment 3:" in r["message"]


def outputs(notebook: Path):
    """The printed text of every cell of an executed notebook."""
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(o.get("text", "")) for c in cells for o in c.get("outputs", []) if o.get("output_type") == "stream"]


def test_every_copy_runs_what_it_can_and_names_what_it_waits_for(kit):
    """In the copy for each assignment N, handed out in sequence: `python train_heads.py --drafters
    medusa,eagle` stops with one line naming assignment N, before training anything; and the notebooks
    that show N's code (notebooks/README.md) run top to bottom on the model the copy came with
    (out/tiny/), their cells that need N saying so; the notebooks that show no assignment's code run in
    the first copy. (tests/test_notebooks.py checks every notebook's guards against the README's table,
    and runs every notebook where nothing is stubbed.)

    So every notebook up to N runs in the copy for N: a notebook that runs in the copy for M runs in
    every later copy, which stubs a subset of what M's stubs. A cell guarded by course.needs(..., K) runs
    in a copy exactly when K comes before the copy's assignment, and tests/test_notebooks.py checks the
    two ways it could then fail where the copy for M did not run it: no cell enters a function of an
    assignment later than its guard names (noted in the unstubbed run), and no statement reads a name that
    only a later guard's statement defines."""
    for n in ASSIGNMENTS:
        proc, out = kit[f"pipeline-{n}"]
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1, out
        assert lines[0].startswith(f"error: train_heads.py needs assignment {n} ("), out
        assert not (kit["base"] / f"in-sequence-{n}" / "out" / "try" / "base.pt").exists()
        assert TEACHING.get(n), f"notebooks/README.md names no notebook showing assignment {n}'s code"
        proc, out = kit["notebooks"]
        assert proc.returncode == 0, out[-3000:]
        ran = json.loads((kit["base"] / "ran.json").read_text())
        for name in shown_in_copy(n):
            error = ran[str(kit["base"] / f"in-sequence-{n}" / "notebooks" / name)]
            assert error == "", f"in the copy for {n}, {name}: {error[-3000:]}"
        for name in TEACHING[n]:
            printed = "".join(outputs(kit["base"] / f"executed-{n}" / name))
            assert f"this cell needs assignment {n} (" in printed, f"in the copy for {n}, no cell of {name} waited for it"


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


def test_hints_name_only_tests_that_run_in_their_copy():
    """A hint or nudge that names a test (a file under tests/ or a test function) names one that runs
    in the copy handed out in sequence, correctness or efficiency: not one listed there as LATER."""
    for n, a in MAPPING["assignment"].items():
        now = (grading.graded_in_sequence(MAPPING["assignment"], n)
               + grading.graded_in_sequence(MAPPING["assignment"], n, "efficiency") + a.get("private", []))
        for key, text in [*a["hints"].items(), *a["stubs"].items()]:
            for name in re.findall(r"tests/[\w/]+\.py(?:::\w+)?|\btest_\w+", text):
                runs = any(t == name or t.startswith((name + "::", name + "[")) or f"::{name}" in t for t in now)
                assert runs, f"assignment {n}, the hint of {key} names {name}, which does not run in its copy"


# Run in the project: pytest.raises that notes, for every error a test expected and got, the function
# that raised it (the innermost frame), the expected types and the pattern.
RAISES = r'''
import json, os, sys
import pytest
import grading
seen, real = [], pytest.raises


class Noted:
    def __init__(self, expected, match):
        self.ctx, self.expected, self.match = real(expected, match=match), expected, match

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, kind, error, tb):
        suppressed = self.ctx.__exit__(kind, error, tb)
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if suppressed and tb is not None:
            code, expected = tb.tb_frame.f_code, self.expected
            seen.append(dict(file=os.path.relpath(code.co_filename), function=code.co_qualname, match=self.match,
                             expected=[e.__name__ for e in (expected if isinstance(expected, tuple) else (expected,))]))
        return suppressed


def raises(expected, *args, match=None, **kw):  # the with-form is noted; pytest.raises(E, f, ...) passes through
    return real(expected, *args, match=match, **kw) if args or kw else Noted(expected, match)


pytest.raises = raises
grading.run_tests(sys.argv[2:])
json.dump(seen, open(sys.argv[1], "w"), indent=1)
'''


def test_errors_the_tests_expect_are_stated_where_students_look(tmp_path):
    """Every error a graded test expects (pytest.raises) from a function students write is stated in
    that function's docstring and in its hint: the type, and the words the pattern matches. An error
    raised by code the student reads (validate_choices, say) shows its words itself."""
    specs = []
    for file in GRADED_FILES:
        module = ast.parse((ROOT / file).read_text())
        raising = {f.name for f in module.body if isinstance(f, ast.FunctionDef) and "pytest.raises(" in ast.unparse(f)}
        specs += [t for n in ASSIGNMENTS for t in graded(n) if t.startswith(f"{file}::")
                  and t.split("::")[1].split("[")[0] in raising]
    out = tmp_path / "raised.json"
    proc = warm.run(["-c", RAISES, str(out), *dict.fromkeys(specs)], ROOT, ENV, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    seen = json.loads(out.read_text())
    stubs = {key: a for a in MAPPING["assignment"].values() for key in a["stubs"]}
    problems = {}
    for raised in seen:
        key = f"{raised['file']}:{raised['function']}"
        if key not in stubs:
            continue  # raised by code the student reads
        file, _, name = key.partition(":")
        docstring = ast.get_docstring(ma.find_function(ast.parse(ma.read_source(ROOT / file)), name)) or ""
        words = [w.strip() for w in re.split(r"\\.|[.*+?()\[\]{}|^$\\]", raised["match"] or "") if w.strip()]
        for where, text in (("docstring", docstring), ("hint", stubs[key]["hints"][key])):
            text = " ".join(text.split())
            missing = [w for w in words if w not in text]
            if not any(e in text for e in raised["expected"]):
                missing.insert(0, " or ".join(raised["expected"]))
            if missing:
                problems.setdefault(key, []).append(f"its {where} lacks {missing}")
    assert {"tree.py:grow_tree", "tree.py:path_probability"} <= {f"{r['file']}:{r['function']}" for r in seen}, seen
    assert not problems, "\n".join(f"{key}: {'; '.join(p)}" for key, p in problems.items())


def test_a_wrong_error_message_is_shown_with_the_pattern_it_missed(tmp_path):
    """grade.py's line for a failed pytest.raises(match=...) holds the pattern and the message it got."""
    script = """
import json, sys, grading
reworded = dict(name="reworded", function="tree.py:grow_tree", replace="supplies 1..", **{"with": "holds 1.."})
with grading.planted(reworded):
    cases = grading.run_tests(["tests/test_tree.py::test_grow_tree_on_a_hand_made_table"])
json.dump(cases, open(sys.argv[1], "w"))
"""
    proc = warm.run(["-c", script, str(tmp_path / "cases.json")], ROOT, ENV, timeout=600)
    [case] = json.loads((tmp_path / "cases.json").read_text()).values()
    assert case["outcome"] == "failed" and "\n" not in case["message"], proc.stdout + proc.stderr
    assert re.search(r"Regex pattern did not match\..*'supplies'.*holds 1\.\.6 nodes", case["message"]), case
