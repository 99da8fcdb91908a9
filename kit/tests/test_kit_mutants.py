"""The grader's own check (instructors): every bug planted from kit/mutants.toml makes one of its
assignment's correctness tests fail (never only an efficiency test), and every correct rewrite
there passes them, a slower one included.

One `python kit/grade.py --mutants` process runs them all, in one pytest session: each fault is planted
in its function in that process only (its code swapped, nothing written), only its listed tests run,
stopping at the first failure, and what the fault changed (fixtures, cached models) is made again."""
import json
import subprocess
import sys

import pytest

from kit_helpers import MAPPING, ROOT, assignments, grading

ASSIGNMENTS = MAPPING["assignment"]
DATA = grading.load_mutants(ASSIGNMENTS, check=False)


def test_every_assignment_has_faults_and_a_correct_rewrite():
    """Each assignment plants faults in each of its functions with a body to get wrong, and has at
    least one correct rewrite (so a grader that fails everything shows up)."""
    for n, a in ASSIGNMENTS.items():
        planted = {m["function"] for m in DATA["mutant"] if m["assignment"] == n}
        trivial = {"kv_cache.py:KVCache.rollback"} - planted  # one line: a fault is planted all the same
        assert set(a["stubs"]) - trivial <= planted, f"assignment {n}: no fault in {set(a['stubs']) - planted}"
        assert any(e["assignment"] == n for e in DATA["equivalent"]), f"assignment {n}: no correct rewrite"


def test_every_planted_fault_is_caught_and_every_correct_rewrite_passes(tmp_path):
    """`python kit/grade.py --mutants`: every fault of every assignment makes one of its graded tests fail
    (a fault whose snippet is no longer in its function fails here too, "no longer applies", never passes
    silently); every correct rewrite passes the tests of its function. The slower one, evaluate_posterior
    with a few ops more a step (one host read, as the reference), passes every correctness test of
    assignment 3 handed out in sequence, and the efficiency tests report it past the ops bound: correctness
    and efficiency are graded apart. (One test: the table is one process's work.)"""
    every = assignments()  # the reach map, read or learned here: grade.py reads it back
    out = tmp_path / "mutants.json"
    proc = subprocess.run([sys.executable, "kit/grade.py", "--mutants", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["mutants"]
    mutants = [r for r in rows if r["kind"] == "mutant"]
    assert len(mutants) == len(DATA["mutant"]) and len(rows) == len(mutants) + len(DATA["equivalent"]), proc.stdout
    missed = [f"{r['name']} ({r['function']}): {r['message'] or 'no graded test failed'}" for r in mutants if not r["ok"]]
    failing = [f"{r['name']}: {r['by']}: {r['message']}" for r in rows if r["kind"] == "equivalent" and not r["ok"]]
    assert not missed and not failing, "\n".join(missed + failing)
    assert proc.returncode == 0 and f"{len(mutants)}/{len(mutants)} planted faults caught" in proc.stdout
    [r] = [r for r in rows if r["kind"] == "equivalent" and "efficiency" in r]
    assert r["assignment"] == "3" and r["cases"] >= len(grading.graded_in_sequence(every, "3")), r
    m = r["efficiency"]["measures"]
    assert m["ops_per_step"] > m["reference_ops_per_step"] and m["ops_ratio"] > m["ops_ratio_bound"], m
    assert m["host_reads_per_step"] <= m["host_reads_bound"], m
    assert f"efficiency: {r['efficiency']['summary'][:60]}" in proc.stdout.replace("\n          ", " ")


def test_no_fault_is_caught_only_by_an_efficiency_test(tmp_path):
    """load_mutants refuses a fault whose tests include an efficiency test: a fault is caught by what
    the code does; what it costs is reported apart."""
    for t in MAPPING["efficiency"]:
        assert not any(grading.matches(t, s) or grading.matches(s, t)
                       for m in DATA["mutant"] + DATA["equivalent"] for s in m.get("tests", [])), t
    path = tmp_path / "mutants.toml"
    path.write_text('[[mutant]]\nassignment = "3"\nname = "costly"\nfunction = "verify.py:evaluate_posterior"\n'
                    'replace = "a"\nwith = "b"\n'
                    'tests = ["tests/test_step_cost.py::test_a_step_launches_few_ops_more_than_a_plain_token"]\n')
    with pytest.raises(grading.UsageError, match="'costly' runs tests/test_step_cost.py::.*, an efficiency test"):
        grading.load_mutants(assignments(), path)


def test_a_fault_that_no_longer_fits_fails_loudly():
    stale = dict(name="stale", function="verify.py:evaluate_posterior", replace="no such code", **{"with": ""})
    source = (ROOT / "verify.py").read_text()
    with pytest.raises(grading.MutantError, match="'stale' no longer applies: snippet 'no such code' not found in evaluate_posterior"):
        grading.planted_source(source, stale)
    gone = dict(stale, function="medusa_mini.py:no_such_function")
    with pytest.raises(grading.MutantError, match="no longer applies: no function 'no_such_function'"):
        grading.planted_source((ROOT / "medusa_mini.py").read_text(), gone)


def test_a_fault_is_written_into_its_function_only():
    """planted_source changes the one function it names (a replace, or a whole body); the rest of the file
    is left byte for byte."""
    source = (ROOT / "verify.py").read_text()
    fault = dict(name="x", function="verify.py:evaluate_posterior", replace="best = lengths.index(accept)",
                 **{"with": "best = 7"})
    planted = grading.planted_source(source, fault)
    assert planted.replace("best = 7", "best = lengths.index(accept)") == source and planted != source
    cache = (ROOT / "kv_cache.py").read_text()
    body = dict(name="y", function="kv_cache.py:KVCache.rollback", body="self.length = 0\n")
    planted = grading.planted_source(cache, body)
    assert "        self.length = 0\n" in planted and planted.count("\n") == cache.count("\n")
