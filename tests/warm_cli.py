"""Command lines run from a warm process: `python train.py ...` and torchrun's launcher,
each in a child forked from one process per test worker that has imported torch, Hydra
and the trainer once.

[Note: warm command lines]
Most of a short command-line test is spent importing: about 3 s of torch, Hydra and the
trainer per process on two busy cores, against a fraction of a second to compose the
config and print a bad input's one line. The suite runs about eighty such command lines.
So `run_cli` (test_cli.py) hands them to a server started once per test worker: it has
imported what every run imports (train.py's own imports, the training loop, torchrun's
launcher, none of them starts a thread or touches a device), and for each command line
it forks a child that runs train.py (or `torch.distributed.run`) as `__main__` with that
argv, working directory and environment, its stdout and stderr in files, its exit code
the one Python would give (SystemExit's code, 1 for an uncaught exception, after the
exit handlers ran), the same command the user types in every other way. The ranks a
launcher starts are new processes, as they are for the user.
What a child cannot inherit from a warm parent stays with a fresh interpreter: variables
read when torch or Python start (ATEN_CPU_CAPABILITY, OMP_NUM_THREADS, ...) must be set
before the server starts, so a command line with an environment of its own beyond
WARM_ENV runs as a plain subprocess, unless each such variable has the value the server
started with (OMP_NUM_THREADS=1, which conftest.py sets for the whole session). Nothing
here imports transformers: the trainer asks whether it is loaded (`_pretrained_class` in
trainer/models/materialize.py). The same server runs the scripts of scripts/ (`python
scripts/x.py ...`, in a working directory of the test's choice) and `python -c`/`python -`:
each is `__main__` in its child as train.py is. `command` stands for `subprocess.run`,
`popen` for `subprocess.Popen` (a test that signals a running job: the Job's pid is the
process running the command line), `popen_to_log` for the jobs of replica groups
(tests/ft_harness.py: several at once, output into one log), `SHIM` for the interpreter
of a script that starts Python itself ([Note: warm python], below). Children run side by
side: the server reaps each as it ends (SIGCHLD wakes its loop) and tells its client the
exit code. `command` and `popen` are the one job of a test at a time: one a failed test
left running is killed when the next starts.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# variables the trainer reads while it runs, not at start: a child may take them
# (SHARDTRAIN_FAULT*: trainer/checkpoint/faults.py reads them when a fault point is reached;
# CUDA_VISIBLE_DEVICES: torch reads it when CUDA initializes, which the server never does;
# RUST_LOG: torchft's logging when torchft is imported, which the server never does)
WARM_ENV = frozenset(
    {"SHARDTRAIN_FAULT", "SHARDTRAIN_FAULT_ONCE", "SHARDTRAIN_FAULT_PAUSE_UNTIL",
     "PYTHONFAULTHANDLER", "CUDA_VISIBLE_DEVICES", "RUST_LOG"}
)  # fmt: skip
# `python` for scripts that run $PY (scripts/gpu_check.sh): [Note: warm python]
SHIM = ROOT / "tests" / "warm_python"
# set by a shell or by pytest for its own bookkeeping; neither Python nor torch reads them
SHELL_ENV = ("SHLVL", "_", "PWD", "OLDPWD", "PYTEST_CURRENT_TEST")

SERVER = r"""
import atexit, faulthandler, json, os, runpy, select, signal, socket, sys, threading, traceback
import types
START_ENV = dict(os.environ)  # before an import sets a variable of its own
import hydra, omegaconf, torch  # what every run imports: once, here
import torch.distributed.run  # torchrun's launcher
import torch._dynamo  # what the first optimizer a process builds imports
import trainer.run.cli, trainer.run.loop  # train.py's own imports and the loop's
assert threading.active_count() == 1, threading.enumerate()  # fork needs one thread
assert "transformers" not in sys.modules
assert "torchft" not in sys.modules  # RUST_LOG: still the child's to set
assert not torch.cuda.is_initialized()  # CUDA_VISIBLE_DEVICES: still the child's to set
SOCKET, WARM_ENV = sys.argv[1], frozenset(json.loads(sys.argv[2]))

def child(case, fds):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_read, wake_write):
        os.close(fd)
    if fds:  # a client's stdin, stdout and stderr
        for fd, own in enumerate(fds):
            os.dup2(own, fd)
        for own in fds:
            os.close(own)
    else:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        # stdout and stderr into their files, or both into one (a shell's 2>&1)
        opened = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            path = case[name]
            if path not in opened:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                opened[path] = os.open(path, flags, 0o644)
            os.dup2(opened[path], fd)
        for f in opened.values():
            os.close(f)
    os.chdir(case["cwd"])
    os.environ.clear()
    os.environ.update(case["env"])
    faulthandler.enable()
    sys.argv = list(case["argv"])
    code = 0
    try:
        if case["module"]:
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        elif sys.argv[0] in ("-", "-c"):  # python - ARGS (the program on stdin), -c CODE ARGS
            source = sys.stdin.read() if sys.argv[0] == "-" else sys.argv.pop(1)
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(source, "<stdin>" if sys.argv[0] == "-" else "<string>", "exec"),
                 main.__dict__)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # as the interpreter ends: non-daemon threads joined, exit handlers run
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

running = {}  # pid of a child -> what to do with its exit code

def serve(case, fds, say, done=lambda: None):
    pid = os.fork()
    if pid == 0:
        listener.close()
        child(case, fds)
    for fd in fds:
        os.close(fd)
    say({"pid": pid})
    running[pid] = lambda code: (say({"code": code}), done())

def reap():
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        running.pop(pid)(os.waitstatus_to_exitcode(status))

def warm_for(case):
    # [Note: warm python]: every variable that differs from the server's start is one
    # read at run time (WARM_ENV) or one the client names as its caller's own
    own = WARM_ENV | set(case["own_env"])
    env = case["env"]
    differ = {k for k in env.keys() | START_ENV.keys() if env.get(k) != START_ENV.get(k)}
    return differ <= own

def client(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        data = data + more if more else b""
    say = lambda msg: conn.sendall((json.dumps(msg) + "\n").encode())
    if not data or len(fds) != 3 or not warm_for(json.loads(data)):
        for fd in fds:
            os.close(fd)
        if data:
            say({"cold": True})
        conn.close()
        return
    serve(json.loads(data), fds, say, conn.close)  # the connection stays open until it ends

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(SOCKET)
listener.listen(8)
reply = os.fdopen(os.dup(1), "w")

def say_stdout(msg):
    reply.write(json.dumps(msg) + "\n")
    reply.flush()

# Children run side by side: each one's end is a SIGCHLD, which wakes the loop below
# through this pipe, and is reaped there.
wake_read, wake_write = os.pipe()
os.set_blocking(wake_write, False)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
say_stdout({"ready": True})

pending = b""
while True:
    ready, _, _ = select.select([0, listener, wake_read], [], [])
    if wake_read in ready:
        os.read(wake_read, 1 << 16)
        reap()
    if 0 in ready:
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            case = json.loads(line)
            serve(case, [], lambda msg, job=case["job"]: say_stdout({"job": job, **msg}))
    if listener in ready:
        client(listener.accept()[0])
"""


class Job:
    """One command line running in a child of the server, used as `subprocess.Popen(...,
    stdout=PIPE, stderr=PIPE, text=True)` is: `pid`, `poll`, `wait`, `communicate`,
    `send_signal`, `kill`, `returncode` (negative: the signal that ended it). `log`: its
    stdout and stderr both into that file instead (`stderr=STDOUT`)."""

    def __init__(
        self,
        server: _Server,
        argv: list[str],
        module: str | None,
        env: dict,
        cwd: Path,
        log: Path | None = None,
    ):
        self.args = argv
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        if log is not None:
            self._out = self._err = log
        self._replies = server.replies_to(self)
        case = {
            "job": id(self), "argv": argv, "module": module, "cwd": str(cwd), "env": env,
            "stdout": str(self._out), "stderr": str(self._err),
        }  # fmt: skip
        server.send(case)
        self.pid: int = self._replies.get()["pid"]
        self.returncode: int | None = None
        self._reader = threading.Thread(target=self._read_code, daemon=True)
        self._reader.start()

    def _read_code(self) -> None:
        self.returncode = self._replies.get()["code"]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            raise RuntimeError(f"the warm server ended before {self.args}")
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._out == self._err:
            return self._out.read_text(), ""
        return self._out.read_text(), self._err.read_text()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not yet reaped by the server: the pid is still its
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self) -> None:
        self.socket = Path(tempfile.mkdtemp(prefix="warm-")) / "socket"  # for `SHIM`s
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.socket), json.dumps(sorted(WARM_ENV))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.start_env = dict(os.environ)  # what the server and each child started under
        atexit.register(shutil.rmtree, self.socket.parent, ignore_errors=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}  # and listening
        self.job: Job | None = None
        self._replies: dict[int, queue.SimpleQueue] = {}  # id of a Job -> what it is told
        self._sending = threading.Lock()
        threading.Thread(target=self._hand_out, daemon=True).start()

    def replies_to(self, job: Job) -> queue.SimpleQueue:
        return self._replies.setdefault(id(job), queue.SimpleQueue())

    def send(self, case: dict) -> None:
        with self._sending:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()

    def _hand_out(self) -> None:
        """Each of the server's replies (a child's pid, then its exit code) to its Job:
        several may run at once (`start_beside`)."""
        for line in self.proc.stdout:
            msg = json.loads(line)
            job = msg.pop("job")
            replies = self._replies.pop(job) if "code" in msg else self._replies[job]
            replies.put(msg)
        for replies in list(self._replies.values()):  # the server is gone
            replies.put({"pid": None, "code": None})

    def start(self, argv: list[str], module: str | None, env: dict, cwd: Path) -> Job:
        """A child for `argv`, the one command line of a test. One still running was left
        behind by a test that failed before it waited: it is killed first."""
        if self.job is not None and self.job.poll() is None:
            self.job.kill()
            self.job.wait()
        self.job = Job(self, argv, module, env, cwd)
        return self.job

    def start_beside(
        self, argv: list[str], module: str | None, env: dict, cwd: Path, log: Path
    ) -> Job:
        """A child for `argv` that runs beside the others the test started (the jobs of
        replica groups), its stdout and stderr into `log`."""
        return Job(self, argv, module, env, cwd, log)

    def run(self, argv: list[str], module: str | None, env: dict, cwd: Path, timeout: float):
        job = self.start(argv, module, env, cwd)
        try:
            out, err = job.communicate(timeout)
        except subprocess.TimeoutExpired:  # as subprocess.run does: kill, then say so
            job.kill()
            out, err = job.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        return subprocess.CompletedProcess(argv, job.returncode, out, err)


_server: _Server | None = None


def _warm_server(extra_env: dict) -> _Server | None:
    """The server, started if need be; None if `extra_env` needs a fresh interpreter:
    a variable beyond WARM_ENV at another value than the server started with."""
    global _server
    if _server is not None and _server.proc.poll() is not None:
        _server = None
    start = os.environ if _server is None else _server.start_env  # a new one: as it is now
    if any(k not in WARM_ENV and start.get(k) != str(v) for k, v in extra_env.items()):
        return None
    if _server is None:
        _server = _Server()
    return _server


def _split(launcher: list[str], args: list[str]) -> tuple[list[str], str | None]:
    """(sys.argv, module) of the child for `launcher + args`."""
    module = launcher[2] if launcher[1:2] == ["-m"] else None
    return ([module, *launcher[3:], *args] if module else args), module


def run(
    launcher: list[str],
    args: list[str],
    env: dict[str, str],
    extra_env: dict,
    timeout: float | None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """`launcher + args` (launcher: [python] or [python, -m, torch.distributed.run, ...];
    args: train.py or a script, then its arguments) in `cwd`, from the warm server when it
    can be ([Note: warm command lines]), else as a subprocess. `extra_env`: the variables
    `env` sets beyond the test process's environment."""
    server = _warm_server(extra_env)
    if server is None:
        return subprocess.run(
            launcher + args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
        )
    return server.run(*_split(launcher, args), env, cwd, timeout)


def _launcher(argv: list[str]) -> tuple[list[str], list[str]]:
    assert argv[0] == sys.executable, argv  # the interpreter the server runs
    split = 3 if argv[1:2] == ["-m"] else 1
    return argv[:split], argv[split:]


def command(
    argv: list[str], extra_env: dict | None = None, timeout: float | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=cwd, env={**os.environ, **extra_env}, capture_output=True,
    text=True, timeout=timeout)` for `argv` = [python, script, ...] or [python, -m, module,
    ...], from the warm server when it can be ([Note: warm command lines])."""
    extra = dict(extra_env or {})
    return run(*_launcher(argv), {**os.environ, **extra}, extra, timeout, cwd)


def popen(argv: list[str], extra_env: dict | None = None, cwd: Path = ROOT):
    """`subprocess.Popen(argv, cwd=cwd, env={**os.environ, **extra_env}, stdout=PIPE,
    stderr=PIPE, text=True)`, from the warm server when it can be: a Job, whose pid is the
    process that runs the command line (torchrun's ranks are its children)."""
    extra = dict(extra_env or {})
    env = {**os.environ, **extra}
    server = _warm_server(extra)
    if server is None:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    launcher, args = _launcher(argv)
    return server.start(*_split(launcher, args), env, cwd)


def popen_to_log(argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT):
    """`subprocess.Popen(argv, cwd=cwd, env=env, stdout=open(log, "w"), stderr=STDOUT)`,
    from the warm server when it can be, beside the other jobs the test started (replica
    groups run at once): a Job. `env`: the whole environment of the command line."""
    removed = os.environ.keys() - env.keys()
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    server = _warm_server(extra) if removed <= WARM_ENV else None
    log.write_text("")  # there from the start, as the shell's redirection makes it
    if server is None:
        with open(log, "w") as out:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    launcher, args = _launcher(argv)
    return server.start_beside(*_split(launcher, args), env, cwd, log)


def shim_env(own: list[str]) -> dict[str, str]:
    """The variables that make `SHIM` run each command line from this process's warm
    server ([Note: warm python]). `own`: the variables the caller sets for the script
    that runs the shim (and that only that script reads)."""
    server = _warm_server({})
    return {
        "WARM_SOCKET": str(server.socket),
        "WARM_PYTHON": sys.executable,
        "WARM_OWN_ENV": " ".join(own),
    }


# [Note: warm python]
# A script that runs Python itself ($PY in scripts/gpu_check.sh: torchrun's launcher, and
# a comparison read from stdin) gets `SHIM` as its interpreter. The shim (this file, run
# as `python -I -S`: no site, no torch) hands its argv, working directory, environment
# and its own stdin, stdout and stderr (the file descriptors themselves, over the
# server's Unix socket) to the warm server, which forks a child for it as for
# `run`; the shim forwards SIGTERM, SIGINT and SIGHUP to that child and ends as it ended
# (exit code, or the same signal). A command line the server cannot run warm becomes the
# real interpreter at once (exec, same argv): an option other than -m, -c or -, no
# server, or an environment that differs from the server's start in a variable that is
# neither in WARM_ENV, SHELL_ENV, nor one the test named as the script's own.


def _client(args: list[str]) -> None:
    python = os.environ["WARM_PYTHON"]

    def cold() -> None:
        os.execv(python, [python, *args])

    if not args:
        cold()
    if args[0] == "-m" and len(args) > 1:
        argv, module = args[1:], args[1]
    elif args[0] == "-c" and len(args) > 1 or args[0] == "-" or not args[0].startswith("-"):
        argv, module = list(args), None
    else:
        cold()
    own = os.environ.get("WARM_OWN_ENV", "").split()
    own += ["WARM_SOCKET", "WARM_PYTHON", "WARM_OWN_ENV", *SHELL_ENV]
    case = {
        "argv": argv, "module": module, "cwd": os.getcwd(), "env": dict(os.environ),
        "own_env": own,
    }  # fmt: skip
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ["WARM_SOCKET"])
    except (KeyError, OSError):
        cold()
    msg = (json.dumps(case) + "\n").encode()
    socket.send_fds(conn, [msg[:1]], [0, 1, 2])
    conn.sendall(msg[1:])
    replies = conn.makefile()
    first = json.loads(replies.readline())
    if first.get("cold"):
        conn.close()
        cold()
    pid = first["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    code = json.loads(replies.readline())["code"]
    if code < 0:  # ended by a signal: end by the same one, as the interpreter would have
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    _client(sys.argv[1:])
