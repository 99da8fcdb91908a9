"""The kit's mapping and its tools, without copies: kit/assignments.toml names real functions once, with a
nudge and a hint each; stubbing a function and putting its body back gives the file back; make_assignment
refuses what it cannot do; the hints name tests that run; an error a student's function must raise is
stated in its docstring and its hint; grade.py says in one line why a test failed."""
import ast
import errno
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "kit")]
import grade  # noqa: E402
import grading  # noqa: E402
import make_assignment as ma  # noqa: E402
import stubs  # noqa: E402

MAPPING = ma.load_mapping(ROOT / ma.MAPPING)
ASSIGNMENTS = MAPPING["assignment"]


def test_mapping_names_real_functions_once():
    """Every stub names a function of a project file, with a one-line nudge; no function is in two
    assignments; a test is correctness or efficiency, never both."""
    seen = {}
    for n, a in ASSIGNMENTS.items():
        assert a["title"] and a["stubs"] and a["tests"], f"assignment {n} needs a title, stubs and tests"
        for key, hint in a["stubs"].items():
            file, _, name = key.partition(":")
            assert name and (ROOT / file).is_file(), f"assignment {n}: {key!r} is not 'file:function'"
            ma.body_range(ma.read_source(ROOT / file), name)  # raises if there is no such function
            assert hint.strip() and "\n" not in hint, f"assignment {n}: the nudge of {key} must be one line"
            assert key not in seen, f"{key} is in assignments {seen[key]} and {n}"
            seen[key] = n
        both = [t for t in a["tests"] if grading.is_efficiency_test(ASSIGNMENTS, t)]
        assert not both, f"assignment {n}: {both[0]} is a correctness test here and an efficiency test elsewhere"
        for spec in a["tests"] + a.get("efficiency", []):
            assert (ROOT / spec.split("::")[0]).is_file(), f"assignment {n}: {spec} is not in a test file"


@pytest.mark.parametrize("file", ["medusa_mini.py", "tree.py", "verify.py", "feature_drafter.py"])
def test_stubbing_any_function_and_restoring_it_gives_back_the_file(file):
    """The rewrite is local: stub every top-level function and method, one at a time, then put the body
    back. Each stub carries the marker commands read (lab/stubs.py), naming its assignment."""
    source = ma.read_source(ROOT / file)
    module = ast.parse(source)
    names = [n.name for n in module.body if isinstance(n, ast.FunctionDef)]
    names += [f"{c.name}.{m.name}" for c in module.body if isinstance(c, ast.ClassDef)
              for m in c.body if isinstance(m, ast.FunctionDef)]
    assert len(names) > 5
    for name in names:
        stubbed = ma.stub_source(source, [(name, "hint")], 7)
        indent = ma.body_range(stubbed, name)[2]
        assert ma.get_body(stubbed, name) == [ma.stub_line(indent, 7, name, "hint")], name
        marker = stubs.stub_message(grading.find_function(ast.parse(stubbed), name))
        assert marker == f"assignment 7: {name.rpartition('.')[2]}: hint", name
        assert ma.replace_body(stubbed, name, ma.get_body(source, name)) == source, name


def test_make_assignment_refuses_bad_directories_and_unknown_numbers(tmp_path, capsys):
    """A clear error and no half-written copy: a non-empty directory, one inside the project, a wrong number."""
    (tmp_path / "old.txt").write_text("keep me")
    assert ma.main(["1", "--out", str(tmp_path)]) == 2
    assert ma.main(["1", "--out", str(ROOT / "student-1")]) == 2  # the next copy would copy this one
    assert ma.main(["99", "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists() and not (ROOT / "student-1").exists()
    assert ma.main([]) == 2 and ma.main(["1", "--out", str(tmp_path / "new"), "--bogus"]) == 2
    assert ma.main(["1", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "under out/" in err and "no assignment '99'" in err and "--bogus" in err
    assert all(line.startswith("error: ") for line in err.splitlines()), err  # one line each, no traceback
    assert ma.main(["--list"]) == 0
    assert "Assignment 1:" in capsys.readouterr().out


def test_hints_in_two_levels(capsys):
    """The stub gives a one-line nudge; grade.py --hint NAME prints the full hint, whole, and says
    clearly (one line, exit 2) when there is no such function."""
    for n, a in ASSIGNMENTS.items():
        assert list(a["hints"]) == list(a["stubs"]), f"assignment {n}: one full hint per stub"
        for key, full in a["hints"].items():
            nudge = a["stubs"][key]
            assert len(nudge) <= 150 and len(full) > 2 * len(nudge), f"{key}: a short nudge, a longer hint"
            assert grade.main(["--hint", key]) == 0
            assert full.strip() in capsys.readouterr().out  # never cut
    assert grade.main(["--hint", "no_such_function"]) == 2
    assert grade.main(["--hint", ""]) == 2
    assert grade.main(["99"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err


def test_grade_refuses_a_folder_for_its_json_before_grading(tmp_path, capsys):
    assert grade.main(["--json", str(tmp_path), "1"]) == 2
    assert "give a file to write, not a folder" in capsys.readouterr().err


def test_grade_refuses_a_read_only_folder_for_its_json_before_grading(tmp_path, monkeypatch, capsys):
    """A stand-in for a read-only folder (the tests may run as root, who can write anywhere): every
    write fails with EROFS. One line, exit status 1, and nothing graded."""
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr("builtins.open", read_only)
    monkeypatch.setattr(grade, "grade", lambda *args: pytest.fail("graded before checking the folder"))
    assert grade.main(["--json", str(tmp_path / "result.json"), "1"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "read-only" in err[0], err


def test_hints_name_only_tests_that_run_in_their_copy():
    """A hint or nudge that names a test (a file under tests/ or a test function) names one that runs
    in the copy handed out in sequence, correctness or efficiency: not one listed there as LATER."""
    for n, a in ASSIGNMENTS.items():
        now = (grading.graded_in_sequence(ASSIGNMENTS, n) + grading.graded_in_sequence(ASSIGNMENTS, n, "efficiency")
               + a.get("private", []))
        for key, text in [*a["hints"].items(), *a["stubs"].items()]:
            for name in re.findall(r"tests/[\w/]+\.py(?:::\w+)?|\btest_\w+", text):
                runs = any(t == name or t.startswith((name + "::", name + "[")) or f"::{name}" in t for t in now)
                assert runs, f"assignment {n}, the hint of {key} names {name}, which does not run in its copy"


def raised_in(function) -> list[tuple[str, str]]:
    """(exception type, its message's literal words) for each `raise X(...)` in a function's body."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            words = " ".join(v.value for v in ast.walk(node.exc) if isinstance(v, ast.Constant) and isinstance(v.value, str))
            found.append((node.exc.func.id, words))
    return found


def test_the_errors_a_students_function_raises_are_stated_where_students_look():
    """Every exception a function students write raises in the reference is named in that function's
    docstring and in its hint, with the words of its message that say what is wrong (a test matches
    them): a student reads both before writing it."""
    problems, checked = [], 0
    for a in ASSIGNMENTS.values():
        for key, hint in a["hints"].items():
            file, _, name = key.partition(":")
            function = grading.find_function(ast.parse(ma.read_source(ROOT / file)), name)
            docstring = " ".join((ast.get_docstring(function) or "").split())
            hint = " ".join(hint.split())
            for kind, words in raised_in(function):
                checked += 1
                key_words = [w for w in re.findall(r"[a-z][a-z-]{5,}", words.lower())[:3]]
                for where, text in (("docstring", docstring), ("hint", hint)):
                    if kind not in text:
                        problems.append(f"{key}: its {where} does not name {kind}")
                    missing = [w for w in key_words if w not in text.lower()]
                    if missing:
                        problems.append(f"{key}: its {where} lacks {missing} of {kind}({words!r})")
    assert checked >= 3 and not problems, "\n".join(problems)


def test_a_wrong_error_message_is_shown_with_the_pattern_it_missed():
    """grade.py's line for a failed pytest.raises(match=...) holds the pattern and the message it got,
    and for any failure where it happened."""
    text = """tests/test_tree.py:5: in test_x
    with pytest.raises(ValueError, match="supplies"):
E   AssertionError: Regex pattern did not match.
E     Expected regex: 'supplies'
E     Actual message: 'holds 1..6 nodes'"""
    message = grading._message(text)
    assert message == ("tests/test_tree.py:5: AssertionError: Regex pattern did not match. Expected regex: "
                       "'supplies'; Actual message: 'holds 1..6 nodes'")
    assert grading._message("x.py:3: in f\n    raise NotImplementedError('assignment 3: f: go')\n"
                            "E   NotImplementedError: assignment 3: f: go") == \
        "x.py:3: NotImplementedError: assignment 3: f: go"
