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
scripts/x.py ...`, in a working directory of the test's choice): each is `__main__` in its
child as train.py is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# variables the trainer reads while it runs, not at start: a child may take them
# (SHARDTRAIN_FAULT*: trainer/checkpoint/faults.py reads them when a fault point is reached)
WARM_ENV = frozenset({"SHARDTRAIN_FAULT", "SHARDTRAIN_FAULT_ONCE", "PYTHONFAULTHANDLER"})

SERVER = r"""
import atexit, faulthandler, json, os, runpy, sys, threading, traceback
import hydra, omegaconf, torch  # what every run imports: once, here
import torch.distributed.run  # torchrun's launcher
import torch._dynamo  # what the first optimizer a process builds imports
import trainer.run.cli, trainer.run.loop  # train.py's own imports and the loop's
assert threading.active_count() == 1, threading.enumerate()  # fork needs one thread
assert "transformers" not in sys.modules

def child(case):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
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

reply = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    case = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(case)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
"""


class _Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.lock = threading.Lock()
        self.start_env = dict(os.environ)  # what the server and each child started under

    def run(self, argv: list[str], module: str | None, env: dict, cwd: Path, timeout: float):
        with tempfile.TemporaryDirectory() as tmp, self.lock:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            case = {
                "argv": argv, "module": module, "cwd": str(cwd), "env": env,
                "stdout": str(out), "stderr": str(err),
            }  # fmt: skip
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            done: list[int] = []
            reader = threading.Thread(
                target=lambda: done.append(json.loads(self.proc.stdout.readline())["code"])
            )
            reader.start()
            reader.join(timeout)
            if reader.is_alive():  # as subprocess.run does: kill, then say so
                os.kill(pid, signal.SIGKILL)
                reader.join()
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(argv, done[0], out.read_text(), err.read_text())


_server: _Server | None = None


def run(
    launcher: list[str],
    args: list[str],
    env: dict[str, str],
    extra_env: dict,
    timeout: float,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """`launcher + args` (launcher: [python] or [python, -m, torch.distributed.run, ...];
    args: train.py or a script, then its arguments) in `cwd`, from the warm server when it
    can be ([Note: warm command lines]), else as a subprocess. `extra_env`: the variables
    `env` sets beyond the test process's environment."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = None
    start = os.environ if _server is None else _server.start_env  # a new one: as it is now
    if any(k not in WARM_ENV and start.get(k) != str(v) for k, v in extra_env.items()):
        return subprocess.run(
            launcher + args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
        )
    if _server is None:
        _server = _Server()
    module = launcher[2] if launcher[1:2] == ["-m"] else None
    argv = [module, *launcher[3:], *args] if module else args
    return _server.run(argv, module, env, cwd, timeout)


def command(
    argv: list[str], extra_env: dict | None = None, timeout: float | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=cwd, env={**os.environ, **extra_env}, capture_output=True,
    text=True, timeout=timeout)` for `argv` = [python, script, ...] or [python, -m, module,
    ...], from the warm server when it can be ([Note: warm command lines])."""
    assert argv[0] == sys.executable, argv  # the interpreter the server runs
    extra = dict(extra_env or {})
    split = 3 if argv[1:2] == ["-m"] else 1
    return run(argv[:split], argv[split:], {**os.environ, **extra}, extra, timeout, cwd)
