"""The run folder: every file a command writes goes through here.

- A file is written whole or not at all: to a temporary file beside it, then renamed over it, so a
  crash, an interrupt or a full disk never leaves half a checkpoint (readers see the old file or the
  new one). The new file gets the mode the umask gives (a temporary file would be 0600).
- A write that fails for want of room or permission is one line (RunError), naming the file.
- A run holds the folder's lock while it works, so a second run in the same folder refuses at once;
  with the lock held, temporary files left by a run that was killed are removed.
"""
import contextlib
import errno
import json
import os

from lab.cli import RunError

TMP_SUFFIX = ".medusa-tmp"  # our temporary files end so: anything else in the folder is never touched


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file


def describe(error: OSError, path) -> str:
    """An OSError while writing `path`, as one line: what the user can do about it."""
    why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "over the disk quota",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied"}.get(error.errno, error.strerror or str(error))
    return f"cannot write {path}: {why}"


def write_atomically(path, write):
    """Call write(binary file) on a temporary file beside `path`, then rename it onto `path`."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise RunError(describe(e, path)) from None
        raise


def write_text(path, text: str):
    write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def write_json(path, data, **kwargs):
    write_text(path, json.dumps(data, **kwargs))


def check_writable(out, keep=True):
    """Make the folder if needed and try a write there, before any long work: a read-only or full
    folder is one line now, not after minutes of training. keep=False: a folder made only for the check
    is removed again (a command that may still refuse leaves nothing behind)."""
    made = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise RunError(describe(e, out)) from None
    try:
        write_text(os.path.join(out, ".writable"), "ok\n")
        os.remove(os.path.join(out, ".writable"))
    finally:
        if made and not keep:
            with contextlib.suppress(OSError):
                os.rmdir(out)


def remove_orphans(out):
    """Temporary files a killed run left behind (only ours: they end in TMP_SUFFIX)."""
    for name in os.listdir(out):
        if name.endswith(TMP_SUFFIX):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))


@contextlib.contextmanager
def locked(out, command="a run"):
    """Hold the folder's lock (out/.lock) while the block runs; a second run in the folder refuses.
    The system releases the lock when the process ends, however it ends. A folder made for a run that
    then stopped (refused, failed) having written nothing is removed again."""
    made = not os.path.isdir(out)
    check_writable(out)
    f = open(os.path.join(out, ".lock"), "a+")
    try:
        try:
            if os.name == "nt":
                import msvcrt
                msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RunError(f"another run is using {out}/ (its lock, {out}/.lock, is held): wait for it to "
                           f"finish, or use another --out") from None
        remove_orphans(out)
        yield
    except BaseException:
        if made and os.listdir(out) == [".lock"]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, ".lock"))
                os.rmdir(out)
        raise
    finally:
        f.close()


@contextlib.contextmanager
def waiting_lock(path):
    """Like locked(), but wait for the lock instead of refusing: two notebooks opened at once that both
    need the tiny run train it once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as f:
        if os.name == "nt":
            import msvcrt
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    continue
        else:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
