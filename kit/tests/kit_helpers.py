"""What the kit's test files share: the project's paths on sys.path, the reach map (read from out/kit/, or
learned once by running the graded files: kit/reach.py) and the student copies as they are handed out,
made once per test process, on demand."""
import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "kit")]
import grading  # noqa: E402
import make_assignment as ma  # noqa: E402
import reach  # noqa: E402

MAPPING = ma.load_mapping(ROOT / ma.MAPPING)
ASSIGNMENTS = list(MAPPING["assignment"])
ENV = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the graded tests use no plugin

# The reach map takes one run of the graded files: begun now, while the tests are collected, in a process of
# its own, it is ready (or nearly) when the first test that needs it runs, and no test process waits idle
# for it. Stopped at exit if it is still running (a run that only collects).
_TRACING = reach.start(ROOT, MAPPING)
if _TRACING is not None:
    atexit.register(lambda: _TRACING.poll() is None and _TRACING.terminate())


@functools.cache
def reach_data() -> dict:
    """kit/reach.py's map of this project (the first call may run the graded files: a lock keeps two
    test processes from doing it twice)."""
    return reach.reach_map(ROOT, MAPPING)


@functools.cache
def assignments() -> dict:
    """The assignments with their tests, as a copy gets them."""
    return grading.load_assignments(MAPPING, ROOT, data=reach_data())


@functools.cache
def _base() -> Path:
    base = Path(tempfile.mkdtemp(prefix="kit-copies-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    return base


@functools.cache
def copy_for(n: str, models=False) -> Path:
    """The copy for assignment n, handed out in sequence (models: with the instructor's trained tiny run);
    its test lists are left empty (the checks that use it do not grade: they need no reach map)."""
    copy = _base() / f"assignment-{n}{'-models' if models else ''}"
    ma.make_assignment(n, copy, models=models, reach=ma.NO_TESTS)
    return copy


def run_pytest(folder, files, before="") -> dict[str, str]:
    """`python -m pytest FILES` in a folder, after running the Python code `before` in the same process:
    {nodeid: "passed", "skipped", or the failure's message}, from its JUnit XML."""
    import xml.etree.ElementTree as ET
    xml = Path(folder) / "junit.xml"
    code = (f"{before}\nimport sys, pytest\nsys.exit(pytest.main(['-o', 'addopts=', '-q', '-p', 'no:cacheprovider', "
            f"'-p', 'no:unraisableexception', '--tb=no', '--junitxml={xml}', *{list(files)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=folder, env=ENV, capture_output=True, text=True,
                          timeout=900)
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        file = case.get("classname").replace(".", "/") + ".py"
        nodeid = f"{file}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcomes[nodeid] = "passed" if problem is None and case.find("skipped") is None else \
            "skipped" if problem is None else problem.get("message", "")
    return outcomes


def grade_in(copy, *args) -> tuple:
    """`python kit/grade.py --json result.json ARGS` in a copy: (the process, its assignments' results)."""
    proc = subprocess.run([sys.executable, "kit/grade.py", "--json", "result.json", *args], cwd=copy,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads((Path(copy) / "result.json").read_text())["assignments"]


def project_copy(target: Path) -> Path:
    """A plain copy of the project's files (not a git checkout), as an instructor's elsewhere."""
    for f in ma.project_files(ROOT):
        (target / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target / f)
    return target
