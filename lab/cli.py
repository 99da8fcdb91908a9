"""What the commands share to talk to the user: two error types, flag types that check their values,
and the way a command ends.

A user's mistake is one line, `error: ...`, and a non-zero exit; a bug keeps its traceback:
- UsageError: the command line asks for something impossible (a bad flag or value, flags that do not
  go together, a device this machine lacks). Exit status 2, as argparse's own.
- RunError: the run cannot go on (a checkpoint that does not fit the request, a full disk, another run
  in the folder). Exit status 1.
Both are raised where input is checked, with the flag or file named. Anything else (a ValueError from
deep inside torch, say) is a bug in our code and prints its traceback.
"""
import argparse
import errno
import math
import os
import signal
import sys
import threading


class UsageError(Exception):
    """A mistake on the command line: printed as one line, `error: ...`, exit status 2."""


class RunError(Exception):
    """A run that cannot go on, for a reason the user can act on: one line, `error: ...`, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose complaints (an unknown flag, a bad value) are a UsageError: one line, not a usage dump."""

    def error(self, message):
        raise UsageError(message)


def integer(low=1, high=None):
    """A flag type: an integer from low to high (inclusive)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} must be " + (f"from {low} to {high}" if high is not None
                                                                    else f"at least {low}"))
        return value
    parse.__name__ = "integer"
    return parse


def number(low=None, high=None, low_open=False):
    """A flag type: a finite float from low to high (low excluded when low_open)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if low is not None and (value < low or (low_open and value == low)):
            raise argparse.ArgumentTypeError(f"{value:g} must be {'above' if low_open else 'at least'} {low:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value:g} must be at most {high:g}")
        return value
    parse.__name__ = "number"
    return parse


def choice(*options):
    """A flag type: one of `options` (strings)."""
    def parse(value):
        if value not in options:
            raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(options)}")
        return value
    parse.__name__ = "choice"
    return parse


def text(value):
    """A flag type: a string that is not empty (an empty --out or --prompt is a mistake, not the default)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def threads(value):
    """--threads: from 1 to this machine's cores (more threads than cores only slow torch down)."""
    cores = os.cpu_count() or 1
    return integer(1, cores)(value)


def interrupt(signum, frame):
    """SIGTERM (`timeout`, `kill`, `docker stop`) as Ctrl-C: the same one line, the same exit status."""
    raise KeyboardInterrupt


def finish(main, argv=None) -> int:
    """Run a command's main and turn the user's mistakes into one line and an exit status: 2 for a
    UsageError, 1 for a RunError, 130 for Ctrl-C or SIGTERM (a training loop saves first: lab/train.py),
    0 when the output pipe closed early (`| head`). Anything else is raised."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        main(argv)
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        quiet_stdout()
        return 0
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # a full or read-only disk, outside our writer
            raise
        quiet_stdout()
        print(f"error: {e.strerror}: {e.filename or 'writing the output'}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def quiet_stdout():
    """After a broken pipe: point stdout at /dev/null, so that Python's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
