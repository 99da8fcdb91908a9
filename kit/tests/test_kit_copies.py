"""Each assignment's copy, as it is handed out (in sequence: the copy for N also stubs every later
assignment): no solution ahead of the student is in it; what the kit wrote into it is all that differs
from the project once the reference bodies are put back; its assignments.toml is its own."""
import pytest

from kit_helpers import ASSIGNMENTS, MAPPING, ROOT, ma


@pytest.mark.parametrize("n", ASSIGNMENTS)
def test_a_copy_holds_no_solution_ahead_of_the_student_and_gives_back_the_project(tmp_path, n):
    """The copy for N: N's functions and every later assignment's are stubs; no line of their reference
    bodies (notebook outputs included) nor a later assignment's full hint is in any text file (checkpoints,
    plots and token arrays are binary). With the reference bodies put back, every file is the project's,
    but for what the kit writes in: each command's first statement (its stop), each notebook's first code
    cell (its guard), the notebook outputs that printed a stubbed function's source, the copy's
    assignments.toml and ASSIGNMENT.md; the kit's instructor-only files are not there."""
    copy = tmp_path / "copy"
    files = ma.make_assignment(n, copy, models=False, reach=ma.NO_TESTS)
    later = ma.later_assignments(MAPPING, n)
    texts = {}
    for p in copy.rglob("*"):
        if p.is_file():
            try:
                texts[p.relative_to(copy).as_posix()] = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                assert p.suffix in (".pt", ".png", ".npy"), f"{p}: neither text nor a checkpoint, plot or token array"
    project = [f for f in ma.project_files(ROOT) if not f.startswith((*MAPPING["exclude"], ma.PRIVATE_DIR))]
    secret = []
    for m in [n] + later:
        lines = ma.solution_lines(ROOT, project, MAPPING["assignment"][m]["stubs"])
        assert sum(map(len, lines.values())) > 5, f"assignment {m}: too few lines of its own to look for: {lines}"
        for key, body in lines.items():
            file, _, name = key.partition(":")
            hint = MAPPING["assignment"][m]["stubs"][key] if m == n else ma.later_hint(n)
            assert ma.get_body(texts[file], name) == [ma.stub_line(ma.body_range(texts[file], name)[2], m, name, hint)], \
                f"copy for {n}: {key} (assignment {m}) is not a stub"
            for line in body:
                where = [f for f, t in texts.items() if line in t]
                assert not where, f"copy for {n}: {where[0]} holds {line!r} from the body of {key} (assignment {m})"
            secret += body
        for key, full in MAPPING["assignment"][m].get("hints", {}).items():
            if m != n:
                assert not any(full.strip()[:80] in t for t in texts.values()), f"copy for {n} holds the hint of {key}"
    mapping = ma.load_mapping(copy / ma.MAPPING)
    assert mapping["default"] == n and list(mapping["assignment"]) == [n] + later
    assert mapping["assignment"][n]["hints"] == MAPPING["assignment"][n]["hints"]
    assert all("hints" not in mapping["assignment"][m] for m in later)
    assert mapping["commands"] == MAPPING["commands"] and mapping["drafters"] == MAPPING["drafters"]
    assert (copy / "ASSIGNMENT.md").read_text().startswith(f"# Assignment {n}: {MAPPING['assignment'][n]['title']}")

    for m in [n] + later:
        ma.restore_bodies(copy, MAPPING["assignment"][m])
    for f in project:
        if f == ma.MAPPING:
            continue
        expected = (ROOT / f).read_bytes()
        if f.endswith(".ipynb"):
            expected = ma.guard_notebook(ma.clear_leaking_outputs(expected.decode("utf-8"), secret)).encode("utf-8")
        elif f in MAPPING["commands"]:
            expected = ma.guard_command(expected.decode("utf-8")).encode("utf-8")
        assert (copy / f).read_bytes() == expected, f"{f} differs"
    for excluded in MAPPING["exclude"]:
        assert not (copy / excluded).exists()
    assert set(files) >= {ma.MAPPING, "ASSIGNMENT.md"} and not (copy / ma.PRIVATE_DIR).exists()
