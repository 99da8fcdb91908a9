"""The kit's mapping and its tools, without copies: kit/assignments.toml names real functions once, with a
nudge and a hint each, and real commands, notebooks and test files; stubbing a function and putting its
body back gives the file back; what make_assignment.py writes into a copy (the commands' stop, the
notebooks' guard) does what it says on small inputs; make_assignment refuses what it cannot do; an error
a student's function must raise is stated in its docstring and its hint; grade.py says in one line why a
test failed. None of them needs the reach map."""
import ast
import errno
import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from kit_helpers import MAPPING, ROOT, ma
import grade  # noqa: E402
import grading  # noqa: E402
import notebook_guard  # noqa: E402
import stubs  # noqa: E402

ASSIGNMENTS = MAPPING["assignment"]


def test_mapping_names_real_functions_commands_notebooks_and_tests():
    """Every stub names a function of a project file, with a one-line nudge; no function is in two
    assignments; every assignment names the notebooks that show its code; the commands, drafters, graded
    files and efficiency tests named exist; no assignment lists its tests (the kit learns them)."""
    seen = {}
    for n, a in ASSIGNMENTS.items():
        assert a["title"] and a["stubs"] and a.get("notebooks"), f"assignment {n} needs a title, stubs and notebooks"
        assert "tests" not in a and "efficiency" not in a, f"assignment {n} lists tests: the kit learns them (kit/reach.py)"
        for key, hint in a["stubs"].items():
            file, _, name = key.partition(":")
            assert name and (ROOT / file).is_file(), f"assignment {n}: {key!r} is not 'file:function'"
            ma.body_range(ma.read_source(ROOT / file), name)  # raises if there is no such function
            assert hint.strip() and "\n" not in hint, f"assignment {n}: the nudge of {key} must be one line"
            assert key not in seen, f"{key} is in assignments {seen[key]} and {n}"
            seen[key] = n
        for name in a["notebooks"]:
            assert (ROOT / "notebooks" / name).is_file(), f"assignment {n}: no notebooks/{name}"
    assert MAPPING["graded"] and all((ROOT / f).is_file() for f in MAPPING["graded"]), MAPPING["graded"]
    for spec in MAPPING["efficiency"]:
        assert spec.split("::")[0] in MAPPING["graded"], f"{spec} is not in a graded file"
        assert f"def {spec.split('::')[1]}(" in (ROOT / spec.split("::")[0]).read_text(), f"no test {spec}"
    for command, entry in MAPPING["commands"].items():
        assert (ROOT / command).is_file() and "__main__" in (ROOT / command).read_text(), f"{command} is not a command"
        assert set(entry["needs"]) <= set(ASSIGNMENTS), f"{command} needs an assignment that does not exist"
        if "drafters" in entry:
            assert f'"{entry["drafters"]}"' in (ROOT / command).read_text(), f"{command} has no flag {entry['drafters']}"
            assert set(entry["default"].split(",")) <= set(MAPPING["drafters"]), command
    assert all(set(ns) <= set(ASSIGNMENTS) for ns in MAPPING["drafters"].values())


@pytest.mark.parametrize("file", ["medusa_mini.py", "tree.py", "verify.py", "kv_cache.py", "feature_drafter.py"])
def test_stubbing_any_function_and_restoring_it_gives_back_the_file(file):
    """The rewrite is local: stub every top-level function and method, one at a time, then put the body
    back. Each stub carries the marker a copy reads (kit/stubs.py), naming its assignment."""
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


# ----------------------------------------------------------------------------------------------
# What make_assignment.py writes into a copy, on small inputs

def test_a_commands_stop_is_its_first_statement_and_reads_its_flags(tmp_path):
    """The stop goes after the docstring and any __future__ import, before every other import; the
    assignments a command needs follow its drafter flag; in a folder whose core has a stub of one of them,
    the command stops with one line and exit status 1 before its own code runs, and runs otherwise; its
    help is always shown."""
    source = '"""A command.\n\n    python cmd.py\n"""\nfrom __future__ import annotations\nimport os\nprint("ran")\n'
    guarded = ma.guard_command(source)
    assert guarded.splitlines()[5] == ma.COMMAND_GUARD.strip() and guarded.replace(ma.COMMAND_GUARD, "") == source
    assert ma.guard_command("import os\n").startswith(ma.COMMAND_GUARD)
    mapping = {"commands": {"cmd.py": {"needs": ["1"], "drafters": "--drafter", "default": "a"}},
               "drafters": {"a": [], "b": ["2"]}}
    assert stubs.needed("cmd.py", [], mapping) == [1]
    assert stubs.needed("cmd.py", ["--drafter", "b"], mapping) == stubs.needed("cmd.py", ["--drafter=b"], mapping) == [1, 2]
    assert stubs.needed("other.py", [], mapping) == []
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "stubs.py").write_text((ROOT / "kit" / "stubs.py").read_text())
    (tmp_path / "kit" / "assignments.toml").write_text(
        '[commands]\n"cmd.py" = { needs = ["1"], drafters = "--drafter", default = "a" }\n[drafters]\na = []\nb = ["2"]\n')
    (tmp_path / "core.py").write_text('def f():\n    """Doc."""\n    raise NotImplementedError("assignment 2: f: go")\n')
    (tmp_path / "cmd.py").write_text(guarded)

    def run(*args):
        return subprocess.run([sys.executable, "cmd.py", *args], cwd=tmp_path, capture_output=True, text=True)
    ran, stopped, helped = run(), run("--drafter", "b"), run("--drafter", "b", "--help")
    assert ran.returncode == 0 and ran.stdout == "ran\n" and not ran.stderr
    assert stopped.returncode == 1 and not stopped.stdout
    assert stopped.stderr.splitlines() == ["error: cmd.py needs assignment 2 (core.py:f), still to write in this copy: "
                                           "write it, then check it with `python kit/grade.py 2`"]
    assert helped.returncode == 0 and helped.stdout == "ran\n"


def test_a_notebook_gets_its_guard_cell_first_and_nothing_else_changes():
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Title"]},
                    {"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": [], "source": ["x = 1"]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 4}
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    guarded = json.loads(ma.guard_notebook(text))
    assert [c["cell_type"] for c in guarded["cells"]] == ["markdown", "code", "code"]
    assert guarded["cells"][1]["source"] == ma.NOTEBOOK_GUARD and guarded["cells"][2] == nb["cells"][1]
    guarded["cells"].pop(1)
    assert json.dumps(guarded, indent=1, ensure_ascii=False) + "\n" == text


def run_cells(guard, namespace, *cells):
    """Each cell as IPython runs it once the guard transforms it: what it printed, and what it showed."""
    printed, shown = io.StringIO(), []
    for cell in cells:
        tree = guard.visit(ast.parse(cell))
        *body, last = tree.body
        with redirect_stdout(printed):
            exec(compile(ast.Module(body, []), "<cell>", "exec"), namespace)
            if isinstance(last, ast.Expr):
                shown.append(eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace))
            else:
                exec(compile(ast.Module([last], []), "<cell>", "exec"), namespace)
    return printed.getvalue().splitlines(), shown


def test_a_notebook_cell_that_reaches_a_stub_says_so_and_so_do_the_cells_that_need_its_names(tmp_path):
    """A cell stopped by a stub prints one line naming the assignment and its functions still to write; a
    later cell that reads a name it set (or changed) is not run and says the same; a cell that sets the
    name again frees it; any other error is the notebook's; the value of a cell's last line is shown."""
    (tmp_path / "core.py").write_text('def f():\n    """Doc."""\n    raise NotImplementedError("assignment 3: f: go")\n')
    guard = notebook_guard.Guard(tmp_path)
    ns = {notebook_guard.SHELL_NAME: guard}
    line = "this cell needs assignment 3 (f), not done in this copy"

    def stub():
        raise NotImplementedError("assignment 3: f: go")
    ns["stub"] = stub
    printed, shown = run_cells(guard, ns, "a = 1\nb = {}\na + 1", "print('before')\nc = stub()\nb['k'] = 2")
    assert printed == ["before", line] and shown == [2] and ns["a"] == 1
    printed, _ = run_cells(guard, ns, "print(c)", "d = [x * a for x in range(2)]\nprint(b)", "print(len(d))")
    assert printed == [line, line, line]
    printed, shown = run_cells(guard, ns, "b = {'new': 1}\nc = 3\nprint(c)", "print(b, c)", "def g(y):\n    return y + c\ng(1)")
    assert printed == ["3", "{'new': 1} 3"] and shown == [None, None, 4]
    with pytest.raises(ZeroDivisionError):
        run_cells(guard, ns, "1 / 0")
    with pytest.raises(NameError):
        run_cells(guard, ns, "never_set")
    found = notebook_guard.names(ast.parse("for i in r: t += i\nwith o as w: z = w\nimport m.n as k\nlambda q: q + s").body)
    assert found.reads == {"r", "t", "o", "s"} and found.binds == {"i", "t", "w", "z", "k"}


def test_a_model_whose_init_is_a_stub_loads_as_a_stand_in():
    """A module whose __init__ is a stub is built without it: no weights, none loaded, moved and cast with its
    model; using it (calling it, asking for a part or its parameters) raises the stub's error."""
    import torch

    class Head(torch.nn.Module):
        def __init__(self, width):
            """Doc."""
            raise NotImplementedError("assignment 1: __init__: go")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(2, 2)
            self.heads = torch.nn.ModuleList([Head(2) for _ in range(3)])

    notebook_guard.stand_in(Head, "x.py:Head.__init__")
    state = {"base.weight": torch.ones(2, 2), "base.bias": torch.zeros(2), "heads.0.proj.weight": torch.ones(3, 2)}
    model = Model()
    model.load_state_dict(state)
    model = model.to(torch.float64).eval()
    assert len(model.heads) == 3 and torch.equal(model.base.weight, torch.ones(2, 2, dtype=torch.float64))
    assert set(model.state_dict()) == {"base.weight", "base.bias"}
    for use in (lambda: model.heads[0](torch.ones(2)), lambda: model.heads[0].proj, lambda: list(model.heads.parameters()),
                lambda: list(model.parameters())):
        with pytest.raises(NotImplementedError, match="^assignment 1: __init__: go$"):
            use()
