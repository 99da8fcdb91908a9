"""tests/warm.py: a command forked from the warm server behaves as `python ARGS` started anew."""
import os
import subprocess
import sys
import time

import pytest

import warm

SHOW = """import os, sys
print(__name__, sys.argv, sys.path[0], os.getcwd(), os.environ.get("WARM_PROBE"))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


def both(args, cwd, env):
    fresh = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return fresh, warm.run(args, cwd, env, timeout=60)


@pytest.mark.parametrize("form", ["-c", "script", "-m"])
def test_a_forked_command_sees_what_a_new_interpreter_sees(tmp_path, form):
    """The same __name__, argv, sys.path[0], folder and environment, the same streams and exit status."""
    (tmp_path / "show.py").write_text(SHOW)
    args = {"-c": ["-c", SHOW, "a", "3"], "script": [str(tmp_path / "show.py"), "a", "3"],
            "-m": ["-m", "show", "a", "3"]}
    env = dict(os.environ, WARM_PROBE="seen")
    fresh, forked = both(args[form], tmp_path, env)
    assert fresh.returncode == 3
    assert (forked.returncode, forked.stdout, forked.stderr) == (3, fresh.stdout, fresh.stderr)


def test_an_uncaught_error_prints_the_commands_own_traceback(tmp_path):
    fresh, forked = both(["-c", "import sys\nraise ValueError('bad input')"], tmp_path, dict(os.environ))
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr == fresh.stderr and "warm.py" not in forked.stderr


def test_a_command_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(["-c", "import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep(60)"], tmp_path,
                 timeout=1)
    pid = int((tmp_path / "pid").read_text())
    for _ in range(100):  # the server reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after its timeout")
