"""Which tests grade which assignment, learned by running them (kit/reach.py): every graded test passes in
the project and the map is whole; in a copy where every assignment is a stub, a test that reaches none
of their functions passes and every other test fails with the error of one it reaches (so with only N
stubbed, exactly the tests that reach N fail, with N's error); the tracer sees what a test reaches
through a fixture, a cache and its file's import; the lists it gives name what the hints and mutants
say."""
import re
import textwrap

from kit_helpers import ASSIGNMENTS, MAPPING, ROOT, assignments, grading, ma, reach, reach_data, run_pytest


def test_every_graded_test_passes_in_the_project_and_grades_what_it_reaches():
    """The map covers the graded files; each test passed in the project; no stubbed function is called
    outside a test (at import, a copy could not import that module); every assignment is graded for
    correctness; the efficiency tests grade the assignments whose code a decoding step runs (1 to 4),
    and greedy Medusa = plain greedy grades them all, end to end."""
    data, every = reach_data(), assignments()
    assert data["graded"] == MAPPING["graded"] and len(data["tests"]) > 100
    assert {nodeid.split("::")[0] for nodeid in data["tests"]} == set(MAPPING["graded"])
    failed = {nodeid: outcome for nodeid, outcome in data["outcomes"].items() if outcome not in ("passed", "skipped")}
    assert not failed, f"graded tests that fail in the project grade nothing: {failed}"
    assert not data["outside"], f"called outside any test (at import?): {data['outside']}"
    for n, a in every.items():
        assert a["tests"], f"no graded test reaches assignment {n}'s functions"
        assert not set(a["tests"]) & set(a["efficiency"])
    end_to_end = "tests/test_decoding.py::test_greedy_medusa_equals_plain_greedy_on_a_trained_model"
    assert [n for n, a in every.items() if end_to_end in a["tests"]] == ["1", "2", "3", "4"]
    assert [n for n, a in every.items() if a["efficiency"] == MAPPING["efficiency"]] == ["1", "2", "3", "4"]
    assert not any(every[n]["efficiency"] for n in ("5", "6"))


def test_the_reference_step_costs_what_the_bounds_are_set_from():
    """The efficiency tests measured, in the traced run, the reference's own ops per step: the figure
    grade.py prints beside a student's (tests/test_step_cost.py, REFERENCE_OPS_PER_STEP)."""
    measures = grading.worst([m for nodeid, m in reach_data()["measures"].items()
                              if any(grading.matches(nodeid, s) for s in MAPPING["efficiency"])])
    assert f"{measures['ops_per_step']:.1f}" == f"{measures['reference_ops_per_step']:.1f}", (
        f"the reference counts {measures['ops_per_step']:.2f} ops per step: update REFERENCE_OPS_PER_STEP in "
        f"tests/test_step_cost.py")
    assert measures["ops_ratio"] <= measures["ops_ratio_bound"] and measures["host_reads_per_step"] <= 1, measures
    assert "over" not in grading.describe_efficiency(measures)


def test_the_copy_that_stubs_everything_fails_as_the_map_says(tmp_path):
    """The copy for assignment 1, handed out in sequence (every assignment a stub): every module imports;
    a graded test that reaches no stubbed function passes there, as in the project; every other fails
    with the NotImplementedError of an assignment whose function it reaches (the first it calls)."""
    data = reach_data()
    copy = tmp_path / "copy"
    ma.make_assignment(ASSIGNMENTS[0], copy, models=False, reach=data)
    imports = "import importlib, pathlib\nfor m in sorted(pathlib.Path('.').glob('*.py')): importlib.import_module(m.stem)"
    got = run_pytest(copy, MAPPING["graded"], before=imports)
    assert set(got) == set(data["tests"])
    of = {key: n for n, a in MAPPING["assignment"].items() for key in a["stubs"]}
    for nodeid, outcome in got.items():
        reached = sorted({of[key] for key in data["tests"][nodeid]})
        if not reached:
            assert outcome in ("passed", "skipped"), f"{nodeid} reaches no stub but fails in the copy: {outcome[:300]}"
        else:
            found = re.search(r"NotImplementedError: assignment (\d+):", outcome)
            assert found and found.group(1) in reached, (
                f"{nodeid} reaches assignments {reached}, but in the copy: {outcome[:300]}")


PROJECT = {  # a project of its own: what the tracer must see, each in one test
    "core.py": '''
        import functools


        def stubbed(x):
            return x + 1


        def other(x):
            return x


        @functools.lru_cache
        def built(n):
            return stubbed(n)


        def at_import():
            return 0
        ''',
    "tests/conftest.py": '''
        import sys, os
        sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
        import pytest
        import core


        @pytest.fixture(scope="session")
        def ready():
            return core.stubbed(1)
        ''',
    "tests/test_a.py": '''
        import core


        def test_calls():
            assert core.stubbed(1) == 2


        def test_calls_nothing():
            assert core.other(1) == 1


        def test_builds():
            assert core.built(3) == 4


        def test_hits_the_cache():
            assert core.built(3) == 4


        def test_uses_the_fixture(ready):
            assert ready == 2


        def test_uses_the_fixture_too(ready):
            assert ready == 2
        ''',
    "tests/test_b.py": '''
        import core
        VALUE = core.at_import()


        def test_only_imports():
            assert VALUE == 0
        ''',
    "kit/assignments.toml": '''
        graded = ["tests/test_a.py", "tests/test_b.py"]
        efficiency = []
        [assignment.1]
        title = "t"
        [assignment.1.stubs]
        "core.py:stubbed" = "n"
        "core.py:at_import" = "n"
        ''',
}


def test_the_tracer_sees_what_a_test_reaches_through_fixtures_caches_and_its_files_import(tmp_path):
    """A test reaches what it calls; what a session fixture it uses called, though an earlier test built
    it; what a cached call computed, though an earlier test filled the cache; what its file called at
    import. The map is kept, keyed by the code: asked again, it is read back."""
    for name, text in PROJECT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "kit" / "reach.py").write_text((ROOT / "kit" / "reach.py").read_text())
    said = []
    data = reach.reach_map(tmp_path, note=said.append)
    assert said and said[0].startswith("learning which tests reach which assignment")
    assert data["outside"] == [] and set(data["outcomes"].values()) == {"passed"}
    stubbed, imported = ["core.py:stubbed"], ["core.py:at_import"]
    assert data["tests"] == {
        "tests/test_a.py::test_calls": stubbed, "tests/test_a.py::test_calls_nothing": [],
        "tests/test_a.py::test_builds": stubbed, "tests/test_a.py::test_hits_the_cache": stubbed,
        "tests/test_a.py::test_uses_the_fixture": stubbed, "tests/test_a.py::test_uses_the_fixture_too": stubbed,
        "tests/test_b.py::test_only_imports": imported}
    assert list((tmp_path / reach.CACHE).glob("reach-*.json"))
    assert reach.reach_map(tmp_path, note=said.append) == data and len(said) == 1  # read back, not run again


def test_the_hints_and_mutants_name_tests_that_run_in_their_copy(capsys):
    """A hint or nudge that names a test (a file under tests/ or a test function) names one that runs
    in the copy handed out in sequence, correctness or efficiency: not one listed there as LATER. Each
    planted fault names correctness tests graded in sequence (grading.load_mutants refuses others).
    make_assignment.py --list prints the lists."""
    every = assignments()
    for n, a in every.items():
        now = (grading.graded_in_sequence(every, n) + grading.graded_in_sequence(every, n, "efficiency")
               + a.get("private", []))
        for key, text in [*a["hints"].items(), *a["stubs"].items()]:
            for name in re.findall(r"tests/[\w/]+\.py(?:::\w+)?|\btest_\w+", text):
                runs = any(t == name or t.startswith((name + "::", name + "[")) or f"::{name}" in t for t in now)
                assert runs, f"assignment {n}, the hint of {key} names {name}, which does not run in its copy"
    grading.load_mutants(every)
    assert ma.main(["--list"]) == 0
    assert "Assignment 1:" in capsys.readouterr().out
