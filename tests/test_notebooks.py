"""The notebooks in notebooks/ run top to bottom in fast mode, import rather than redefine the code, and
their committed outputs agree with each other.

Each notebook runs in a kernel of its own (nbclient, which nbmake and nbconvert run on), with
MEDUSA_FAST=1 in the kernel's environment, so the notebooks use the tiny model here even on a machine
where `python train_heads.py` has written a real out/medusa.pt; the tiny model is trained first, once.
The same runs by hand, through nbmake (the pytest plugin, pinned in requirements.txt):
MEDUSA_FAST=1 python -m pytest -p nbmake --nbmake notebooks. The other tests read the committed notebooks (their
code and the outputs of the run that made them). How long each takes is in docs/results.md, not here.
"""
import ast
import glob
import json
import os
import re
import sys

import pytest

from conftest import tiny_run_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "[0-9]*.ipynb")))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))


def cells(notebook, kind):
    return [c for c in json.load(open(notebook, encoding="utf-8"))["cells"] if c["cell_type"] == kind]


def code_of(notebook):
    return "\n".join("".join(c["source"]) for c in cells(notebook, "code"))


def printed(notebook):
    """The text a committed notebook's cells printed or returned (pictures left out), cell by cell."""
    out = []
    for c in cells(notebook, "code"):
        text = []
        for o in c.get("outputs", []):
            if o["output_type"] == "stream":
                text.append("".join(o["text"]))
            elif o["output_type"] in ("execute_result", "display_data") and "text/plain" in o["data"]:
                text.append("".join(o["data"]["text/plain"]))
        out.append("".join(text))
    return out


def test_the_course_has_nine_numbered_notebooks():
    """notebooks/01_... to 09_...: the reading order in notebooks/README.md."""
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom_in_fast_mode(notebook, monkeypatch):
    """Every cell runs without error, offline, on the tiny model."""
    import nbformat  # here, not above: importing it takes a second, which a worker that runs no notebook saves
    from nbclient import NotebookClient
    tiny_run_folder()  # trained once, before the first notebook
    monkeypatch.setenv("MEDUSA_FAST", "1")  # the kernel inherits this process's environment
    monkeypatch.delenv("MPLBACKEND", raising=False)  # inline plots, as a reader sees them
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": os.path.dirname(notebook)}}).execute()


FORBIDDEN = [r"class\s+\w+\s*\(.*nn\.Module", r"def\s+medusa_generate\b", r"def\s+feature_generate\b",
             r"def\s+(generate|tree_decoding|evaluate_posterior|build_tree_buffers|generate_candidates)\b",
             r"def\s+(prefill|verify_step|update_inputs|sample_tree_walk|speculative_generate)\b",
             r"def\s+(chain_hits|chain_outputs|eagle_loss|mtp_losses|chi_square|true_joint|exact_sampling_ceiling)\b"]
# The project's library modules a notebook may import (commands are refused by tests/test_imports.py).
ALLOWED = {"course", "medusa_mini", "kv_cache", "tree", "verify", "eagle", "eagle3", "mtp", "feature_drafter", "smollm",
           "lab"}
PROJECT = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))} | {"course", "lab", "kit"}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_notebook_imports_the_model_and_decoding_code(notebook):
    """No notebook defines its own model, attention, tree buffers, drafters or decoding loop: they import
    medusa_mini, tree, verify, eagle and mtp, and only library modules of the project."""
    code = code_of(notebook)
    for pattern in FORBIDDEN:
        assert not re.search(pattern, code), f"{os.path.basename(notebook)} matches {pattern!r}"
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert {"medusa_mini", "tree"} <= names, f"{os.path.basename(notebook)} does not import medusa_mini and tree"
    assert names & PROJECT <= ALLOWED, f"{os.path.basename(notebook)} imports {sorted(names & PROJECT - ALLOWED)}"


# A float the printing gave up on: nan, inf, -inf (1.2x, 3% after it), not a word or a quoted token.
NOT_A_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?(nan|inf)(?:x|%)?(?![A-Za-z_])")
QUOTED = re.compile(r"'[^'\s]*'|\"[^\"\s]*\"")  # tokens print quoted, spaces as ·: '·inf' is a token, not a figure


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_no_committed_output_prints_nan_or_inf(notebook):
    """A figure a reader sees is a number: no committed output prints nan or inf where one should be."""
    for i, text in enumerate(printed(notebook)):
        for line in text.splitlines():
            hit = NOT_A_NUMBER.search(QUOTED.sub("''", line))
            assert hit is None, f"{os.path.basename(notebook)}, code cell {i}: {line.strip()[:200]!r}"


ALLOWED_NUMBERS = os.path.join(ROOT, "notebooks", "allowed_numbers.txt")
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?:x|%)?|(?<![\w.])\d+(?:x|%)(?!\w)")  # 1.55, 10%, 2.97x; not 3 or 2048
REFERENCE = re.compile(r"\b(?:[Ss]ections?|Figs?\.|Table|arXiv)\s+\d+(?:\.\d+)*(?:\s*(?:,|and|-)\s*\d+(?:\.\d+)*)*")


def without_markup(markdown):
    """A markdown cell with its code blocks left out, and each code span and formula (LaTeX) standing as one
    word, x; link targets left out."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " x ", text)
    text = re.sub(r"\$\$.*?\$\$", " x ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]*\$", " x ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def prose_figures(markdown):
    """The decimal numbers, percentages and Nx of a markdown cell's prose: code, LaTeX, link targets and
    section, figure or table numbers left out."""
    return FIGURE.findall(REFERENCE.sub("", without_markup(markdown)))


def allowed_numbers():
    """notebooks/allowed_numbers.txt: {figure: why it may be typed}."""
    rows = [line.split(None, 1) for line in open(ALLOWED_NUMBERS, encoding="utf-8")
            if line.strip() and not line.startswith("#")]
    assert all(len(row) == 2 for row in rows), "each line of allowed_numbers.txt gives a figure and its reason"
    return {figure: reason.strip() for figure, reason in rows}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_no_run_figure_is_typed_into_the_prose(notebook):
    """A figure a run produces is printed by a cell, never typed: it would go stale with the next run.
    Every decimal number, percentage and Nx in the markdown is one notebooks/allowed_numbers.txt lists,
    with its reason (a constant, a default, the paper's)."""
    allowed = allowed_numbers()
    for i, cell in enumerate(cells(notebook, "markdown")):
        typed = [f for f in prose_figures("".join(cell["source"])) if f not in allowed]
        assert not typed, f"{os.path.basename(notebook)}, markdown cell {i}: {typed} (print it from a cell, or list it)"


def test_the_typed_figure_check_catches_a_sum_and_a_copy():
    """What it was written for: a sum of run figures typed into the prose, and a copy of a printed one."""
    assert prose_figures("they sum to 0.73 + 0.46 = 1.19 before, about +0.04") == ["0.73", "0.46", "1.19", "0.04"]
    assert prose_figures("where the 64-node tree timed here costs 2.97x, 10% more") == ["2.97x", "10%"]
    assert prose_figures("paper section 2.3.3, Fig. 4, `lr = 3e-3`, $0.8^k$, [a](x/1.5.md), 64 nodes") == []


CHOSEN = re.compile(r"^chosen tree: \d+ nodes \[.*\]$", re.MULTILINE)  # course.chosen_tree's one format


def test_every_notebook_prints_the_same_chosen_tree():
    """The committed outputs come from one run: each notebook that reads the chosen tree prints it once, in
    course.chosen_tree's format, and every one of them prints the same tree."""
    lines = {}
    for notebook in NOTEBOOKS:
        found = [m.group(0) for text in printed(notebook) for m in CHOSEN.finditer(text)]
        if "course.chosen_tree(" in code_of(notebook):
            assert len(found) == 1, f"{os.path.basename(notebook)} prints its chosen tree {len(found)} times"
            lines[os.path.basename(notebook)] = found[0]
        else:
            assert not found, f"{os.path.basename(notebook)} prints a chosen tree without course.chosen_tree"
    assert len(lines) >= 2
    assert len(set(lines.values())) == 1, "notebooks from different runs: " + "; ".join(
        f"{name}: {line[:80]}" for name, line in lines.items())


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_notebook_has_exercises_that_assert(notebook):
    """Two or three predict-then-run exercises: a prediction that starts as None, and a check that asserts it
    against the answer once it is filled in (course.predicted), never printing the answer."""
    code = code_of(notebook)
    predictions = set(re.findall(r"^(prediction_\d+) = None$", code, re.MULTILINE))
    assert 2 <= len(predictions) <= 3, f"{os.path.basename(notebook)}: {sorted(predictions)}"
    for name in predictions:
        assert f"course.predicted({name})" in code and re.search(rf"assert[^\n]*\b{name}\b", code), name
    assert not re.search(r"print\([^\n]*\banswer_\d+\b", code), "an exercise prints its answer"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_exercise_check_cells_hide_their_source(notebook):
    """An exercise's check cell (the code cell that calls course.predicted) works the answer out: its source
    is hidden (cell metadata jupyter.source_hidden), so a reader sees the question and the verdict, not the
    method, before predicting."""
    checks = [(i, c) for i, c in enumerate(cells(notebook, "code")) if "course.predicted(" in "".join(c["source"])]
    assert checks, f"{os.path.basename(notebook)} has no exercise check cell"
    shown = [i for i, c in checks if not c.get("metadata", {}).get("jupyter", {}).get("source_hidden")]
    assert not shown, f"{os.path.basename(notebook)}: code cells {shown} check an exercise with their source shown"


ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|et al|etc|Fig|Figs|Eq|vs|cf|Sec)\.")
WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")


def prose(markdown):
    """A markdown cell's running prose: without_markup, and tables and headings left out too (a table is
    not a sentence to read aloud)."""
    return "\n".join(line for line in without_markup(markdown).splitlines() if not re.match(r"\s*(\||#)", line))


def sentence_lengths(markdown):
    """Words per sentence of a markdown cell. A sentence ends at . ! or ? before a space (not after e.g.,
    i.e., et al. or Fig.), at a blank line, or where a list item starts; a word is a run of letters and
    digits, and a formula or a code span counts as one word."""
    text = ABBREVIATIONS.sub(lambda m: m.group(1), prose(markdown))
    pieces = re.split(r"(?<=[.!?])\s+|\n\s*\n|\n\s*(?:[-*]|\d+\.)\s+", text)
    return [n for n in (len(WORD.findall(p)) for p in pieces) if n]


def test_sentence_lengths_count_what_a_reader_reads():
    """The measure below on a cell whose counts are known: three sentences, a list of two, a table and code."""
    cell = ("Verification costs one pass, e.g. on a CPU. It is `verify.tree_decoding`, with $N$ nodes!\n\n"
            "| a | b |\n|---|---|\n\n- first item here\n- second\n\n```python\nx = 1. y = 2.\n```\nLast one?")
    assert sentence_lengths(cell) == [8, 6, 3, 1, 2]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_prose_is_short(notebook):
    """The course reads in short sentences (issue 45): sentences of a notebook's markdown average under 25
    words, and no markdown cell runs over 300 words (sentence_lengths says what counts)."""
    lengths = [sentence_lengths("".join(c["source"])) for c in cells(notebook, "markdown")]
    words = [n for cell in lengths for n in cell]
    mean = sum(words) / len(words)
    longest = max(sum(cell) for cell in lengths)
    assert mean < 25, f"{os.path.basename(notebook)}: sentences average {mean:.1f} words"
    assert longest <= 300, f"{os.path.basename(notebook)}: a markdown cell of {longest} words"
