"""Python commands and Jupyter kernels started from a process that has already imported torch.

Importing torch is most of what a new Python process costs to start, and the suite starts about forty
(the assignment kit's commands in its copies, the notebooks' kernels, ...). So each pytest process that
starts commands starts one server first: it imports torch, numpy and ipykernel (nothing of this project;
it starts no thread and computes no tensor), then forks a child per command. The child takes the
command's working directory, environment, arguments and standard streams, runs it as `python ARGS`
would (a script, -c CODE or -m MODULE, with sys.path[0] set the same way), and exits with its status.
Besides the modules already imported, what differs from a new interpreter: common.FAST_MALLOC (the
server starts with it) and Python's start-up flags. On Linux only (fork, and Unix sockets that keep
messages apart); elsewhere run() starts a new interpreter, and kernels start as usual.

    run(args, cwd, env, timeout)       in a test: like subprocess.run([python, *args], capture_output=True)
    python tests/warm.py serve PATH    the server, listening at PATH (stdin: its lifeline; closed, it kills
                                       its children and exits)
    python tests/warm.py launch ARGS   a thin client for a kernelspec's argv: the child uses its streams, and
                                       gets the signals (an interrupt) it receives; exits with the child's status
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile

AVAILABLE = sys.platform == "linux"
SOCKET = "MEDUSA_WARM_SOCKET"  # the environment variable naming a running server's socket
KERNEL = "medusa-warm"  # the kernelspec whose kernels are forked (kernelspec())


def serve(path):
    import ipykernel.kernelapp  # noqa: F401  what children import first
    import numpy  # noqa: F401
    import torch
    torch.optim.AdamW([torch.nn.Parameter(torch.empty(1))])  # the first optimizer imports torch._dynamo
    sys.path[0] = ""  # this file's folder is no child's business
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    children, killed = {}, set()  # pid: its client's connection; pids killed because their client left
    while True:
        readable, _, _ = select.select([sys.stdin, listener, *children.values()], [], [], 0.05)
        for source in readable:
            if source is sys.stdin and not sys.stdin.readline():  # the test process is gone
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
                return
            if source is listener:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    for sock in (listener, *children.values()):
                        sock.close()
                    child(json.loads(message), fds, connection)
                for fd in fds:
                    os.close(fd)
                connection.send(str(pid).encode())
                children[pid] = connection
            elif source in children.values():  # a client that left (timed out, killed): its child goes too
                pid = next(p for p, c in children.items() if c is source)
                if pid not in killed:
                    killed.add(pid)
                    os.kill(pid, signal.SIGKILL)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid)
            killed.discard(pid)
            try:
                connection.send(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass
            connection.close()


def child(request, fds, connection):
    """Become `python ARGS` in the request's folder, environment and streams; never returns."""
    import atexit
    import random
    import runpy
    import traceback
    import types
    connection.close()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()
    __import__("numpy").random.seed()
    args = request["args"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [os.getcwd() if args[0] == "-m" else "" if args[0] == "-c"
                    else os.path.dirname(os.path.realpath(args[0])), *extra]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy._run_module_as_main(args[1])
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # the traceback from the command's own frames, as python prints it
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def request(args, cwd, env, fds, timeout=None):
    """Have the server run `python ARGS` on the three file descriptors; (its pid, a function that waits
    for its exit status, None on timeout)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(env.get(SOCKET) or os.environ[SOCKET])
    socket.send_fds(connection, [json.dumps(dict(args=list(args), cwd=os.path.abspath(cwd), env=env)).encode()], fds)
    pid = int(connection.recv(64))

    def wait():
        connection.settimeout(timeout)
        try:
            return int(connection.recv(64))
        except TimeoutError:
            return None
        finally:
            connection.close()  # before the child ended: the server kills it
    return pid, wait


_server = None


def server() -> str:
    """This process's server (started on first use, ended when this process ends): its socket's path."""
    global _server
    if _server is None:
        from common import FAST_MALLOC
        folder = tempfile.mkdtemp(prefix="warm-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, **FAST_MALLOC})
        assert proc.stdout.readline() == b"ready\n", "the warm server did not start"
        _server = proc, path  # its stdin stays open while this process lives
    return _server[1]


def run(args, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    forked from the server. The environment gets SOCKET, so a command it starts can use the server too."""
    env = dict(os.environ if env is None else env)
    if not AVAILABLE:
        return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    env[SOCKET] = server()
    with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        _, wait = request(args, cwd, env, [stdin.fileno(), out.fileno(), err.fileno()], timeout)
        status = wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if status is None:
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *args], status, stdout, stderr)


def kernelspec(folder) -> str:
    """Write a kernelspec whose kernels are forked from the server named by SOCKET; the kernel name. Put
    FOLDER on JUPYTER_PATH before the kernel manager looks it up."""
    spec = os.path.join(folder, "kernels", KERNEL)
    os.makedirs(spec, exist_ok=True)
    argv = [sys.executable, os.path.abspath(__file__), "launch", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump(dict(argv=argv, display_name="Python 3 (forked)", language="python"), f)
    return KERNEL


def launch(args):
    pid, wait = request(args, os.getcwd(), dict(os.environ), [0, 1, 2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda sig, _: os.kill(pid, sig))
    status = wait()
    sys.exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "launch":
        launch(sys.argv[2:])
