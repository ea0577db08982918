"""DiLoCo against per-step sync over a real rate-limited link: the tables of
docs/fault_tolerance.md, "DiLoCo across slow links" ("Measured over a rate-limited link").

    python scripts/benchmarks/bench_diloco.py            # as root; about 12 min on 2 cores
    python scripts/benchmarks/bench_diloco.py --quick    # smoke: fewer steps, 10mbit only

Three network namespaces made here (one per replica group, one for torchft's Lighthouse),
joined by veth pairs whose 10.213.2x.0/24 addresses exist only inside them: nothing leaves
the machine. The groups' data link is limited on both ends (`tc qdisc add dev X root tbf
rate R burst 32kbit latency 400ms`; unlimited: no qdisc), each rate measured first with a
bounded TCP transfer. The Lighthouse reaches each group over its own unlimited pair and each
group advertises its data-link address (ft.advertise_host): collectives and heals across
groups take the limited link, heartbeats and quorums do not. Two one-rank groups
(OMP_NUM_THREADS=1 each) train a GPT synced every step, with ft.semi_sync=diloco (F
fragments, each tau of --delays; fp32, int8), and (unless --no-torchft) with torchft's own
torchft.local_sgd.DiLoCo (fp32; each group this script with --torchft-group). The machine
is shared, so each run compares within itself: the link switches between unlimited and R
every --window s; each logging interval (DiLoCo: one sync period) wholly inside one setting
is a sample of it (a run's first and last left out). Per setting: the median interval's
step time, mean bytes across groups per step and ft/wait_ms_per_step; utilization = step
time unlimited / limited, the median over limited windows against their unlimited
neighbours (load drifts). Outer syncs are counted from the Lighthouse's quorums, logs
searched for timeouts and retries. Namespaces, veths, qdiscs and processes go on any exit.
Exits 1 where a run fails, a timeout or retry shows, the quorums are not the schedule's or
the groups' models differ; 2 where namespaces or tbf cannot be made."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA, TO_A, TO_B = "10.213.20", "10.213.21", "10.213.22"  # /24 each, inside the namespaces
A_DATA, B_DATA = f"{DATA}.1", f"{DATA}.2"  # the limited link's ends: what the groups advertise
LH_FROM = {"a": f"{TO_A}.1", "b": f"{TO_B}.1"}  # the Lighthouse, as each group reaches it
MODEL = ["model=gpt", "data=tokens", "model.n_layer=4", "model.n_embd=64", "model.n_head=2"]
JOB = [*MODEL, "train.batch_size=32", "ckpt.every=0", "train.eval_every=0",
       "train.peak_every=1000000", "ft.enabled=true", "ft.replica_groups=2"]  # fmt: skip
LIGHTHOUSE = ["--min_replicas=2", "--join_timeout_ms=60000", "--quorum_tick_ms=10",
              "--heartbeat_timeout_ms=1000"]  # fmt: skip
FIGURES = ("perf/step_time_s", "comm/bytes_per_step/ft_across_replica_groups",
           "ft/wait_ms_per_step")  # fmt: skip
# what a group says when a collective, a quorum or a heartbeat timed out, a sync or step was
# sent again, or a group was lost from the quorum (trainer/comm/replicas.py, diloco.py)
TROUBLE = re.compile(r"time[d ]?out|did not commit|\b1 of 2 replica groups|stopping", re.I)

PROBE = r"""
import socket, sys, time
mode, host, port, n, timeout = sys.argv[1:]
port, n, timeout = int(port), int(n), float(timeout)
if mode == "recv":
    srv = socket.create_server((host, port))
    srv.settimeout(timeout)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    got = 0
    while got < n:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    conn.sendall(b"k" if got == n else b"x")
else:
    s = socket.create_connection((host, port), timeout)
    s.settimeout(timeout)
    t = time.perf_counter()
    s.sendall(bytes(n))
    ok = s.recv(1) == b"k"
    print(time.perf_counter() - t if ok else "short")
"""
# Waits up to 60 s for a server to accept connections at (host, port).
REACH = r"""
import socket, sys, time
end = time.monotonic() + 60
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close()
        break
    except OSError:
        if time.monotonic() > end:
            raise SystemExit(1)
        time.sleep(0.05)
"""


class Net:
    """The namespaces (a, b: the groups; l: the Lighthouse), their veth pairs, and every
    process started in them (each in a session of its own). `close` undoes all of it."""

    def __init__(self) -> None:
        tag = f"bd{os.getpid()}"  # veth names: at most 15 characters
        self.ns = {k: f"{tag}-{k}" for k in "abl"}
        self.pairs = {  # (namespace, device, address) of each end
            "data": (("a", f"{tag}ab", A_DATA), ("b", f"{tag}ba", B_DATA)),
            "la": (("l", f"{tag}la", f"{TO_A}.1"), ("a", f"{tag}al", f"{TO_A}.2")),
            "lb": (("l", f"{tag}lb", f"{TO_B}.1"), ("b", f"{tag}bl", f"{TO_B}.2")),
        }
        self.made: list[str] = []
        self.veths: list[str] = []  # made in the root namespace: deleted there if not moved
        self.procs: list[subprocess.Popen] = []
        self.closed = False

    def make(self) -> None:
        for ns in self.ns.values():
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for (x, dx, ax), (y, dy, ay) in self.pairs.values():
            ip("link", "add", dx, "type", "veth", "peer", "name", dy)
            self.veths.append(dx)
            for ns, dev, addr in ((x, dx, ax), (y, dy, ay)):
                ip("link", "set", dev, "netns", self.ns[ns])
                ip("-n", self.ns[ns], "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", self.ns[ns], "link", "set", dev, "up")

    def limit(self, rate: str | None) -> None:
        """Both ends of the data link at `rate` (tc's tbf), or no qdisc at all."""
        for ns, dev, _ in self.pairs["data"]:
            run(["tc", "-n", self.ns[ns], "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                run(["tc", "-n", self.ns[ns], "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                     rate, "burst", "32kbit", "latency", "400ms"])  # fmt: skip

    def start(
        self, ns: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        with open(log, "w") as out:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[ns], *argv], cwd=ROOT,
                                 env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its session: anything it started too
            except ProcessLookupError:  # ended since the poll
                pass
        p.wait()

    def close(self) -> None:
        """Each step on its own: one that fails is said and the rest still run."""
        if self.closed:
            return
        self.closed = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: cleaned up still
        steps = [lambda p=p: self.stop(p) for p in self.procs]
        for ns in self.made:  # anything left inside was started by one of the above
            steps += [lambda ns=ns: _kill_inside(ns),
                      lambda ns=ns: run(["ip", "netns", "del", ns])]  # fmt: skip
        # a veth never moved into a namespace (a failed make); the others went with theirs
        steps += [lambda d=d: run(["ip", "link", "del", d], check=False) for d in self.veths]
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: PERF203 - every step is tried
                print(f"cleanup: {e}", file=sys.stderr)


def _kill_inside(ns: str) -> None:
    for pid in run(["ip", "netns", "pids", ns], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def ip(*args: str) -> None:
    run(["ip", *args])


def probe(net: Net, src: str, dst_addr: str, dst: str, nbytes: int, timeout: float) -> float:
    """Mb/s of one bounded TCP transfer of `nbytes` from namespace `src` to `dst`."""
    recv = subprocess.Popen(
        ["ip", "netns", "exec", net.ns[dst], sys.executable, "-c", PROBE, "recv", dst_addr,
         "5201", str(nbytes), str(timeout)], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    net.procs.append(recv)
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the probe's receiver in {net.ns[dst]} did not start")
        r = run(["ip", "netns", "exec", net.ns[src], sys.executable, "-c", PROBE, "send",
                 dst_addr, "5201", str(nbytes), str(timeout)], timeout=timeout + 10)  # fmt: skip
        took = r.stdout.strip()
        if took == "short" or not took:
            raise RuntimeError(f"the probe from {src} to {dst} did not arrive whole")
        return nbytes * 8 / float(took) / 1e6
    finally:
        net.stop(recv)


def lighthouse(net: Net, port: int, log: Path) -> subprocess.Popen:
    """torchft's Lighthouse in namespace l, once group a's namespace reaches it."""
    binary = str(Path(sys.executable).with_name("torchft_lighthouse"))
    env = {**os.environ, "RUST_LOG": "info"}  # its quorum lines: what collect() counts
    p = net.start("l", [binary, f"--bind=0.0.0.0:{port}", *LIGHTHOUSE], log, env)
    argv = [sys.executable, "-c", REACH, LH_FROM["a"], str(port)]
    if run(["ip", "netns", "exec", net.ns["a"], *argv], False, 90).returncode:
        raise RuntimeError(f"the Lighthouse did not start within 60 s: {log.read_text()[-300:]}")
    return p


Launch = Callable[[int, str, str, Path], list[str]]  # (group, Lighthouse URL, host, dir)


def one_run(
    net: Net, out: Path, port: int, launch: Launch, rate: str, a: argparse.Namespace
) -> dict:
    """Both groups (`launch(g, url, host, run_dir)`: a group's argv), through a Lighthouse
    of their own, the data link switched between unlimited and `rate` every a.window
    seconds once both train: exit codes, the steady intervals at each setting, the
    quorums the Lighthouse formed, trouble."""
    out.mkdir(parents=True)
    net.limit(None)
    lh = lighthouse(net, port, out / "lighthouse.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDTRAIN_FAULT", "RANK"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RUST_LOG="warn")
    procs = []
    for g, (ns, addr) in enumerate((("a", A_DATA), ("b", B_DATA))):
        argv = launch(g, f"http://{LH_FROM[ns]}:{port}", addr, out / f"g{g}")
        procs.append(net.start(ns, argv, out / f"g{g}.log", env))
    switches: list[tuple[float, str | None]] = [(0.0, None)]  # (time.time(), setting)
    deadline, turn, codes = time.monotonic() + a.timeout, None, [None, None]
    while any(c is None for c in codes):
        codes = [p.poll() for p in procs]
        if time.monotonic() > deadline:
            for g, p in enumerate(procs):
                net.stop(p)
                codes[g] = codes[g] if codes[g] is not None else f"killed after {a.timeout:g} s"
        if turn is None and all(training(out / f"g{g}.log") for g in range(2)):
            turn = time.monotonic() + a.window
        if turn is not None and time.monotonic() >= turn and any(c is None for c in codes):
            setting = rate if switches[-1][1] is None else None
            net.limit(setting)
            switches.append((time.time(), setting))
            turn += a.window
        time.sleep(0.05)
    net.stop(lh)
    net.limit(None)
    (out / "switches.json").write_text(json.dumps(switches))  # to look at the run again
    return collect(out, rate, codes, switches, a.margin)


def collect(
    out: Path, rate: str, codes: list, switches: list[tuple[float, str | None]], margin: float
) -> dict:
    """What one_run returns, from a run's directory (logs, figures) and its switches."""
    logs = [(out / f"g{g}.log").read_text() for g in range(2)]
    trouble = [ln.strip() for log in logs for ln in log.splitlines() if TROUBLE.search(ln)]
    said = (out / "lighthouse.log").read_text()
    ids = [int(i) for i in re.findall(r"bumping quorum_id to (\d+)", said)]
    if max(ids, default=1) > 1:  # a group left the quorum (a heartbeat timed out) or joined
        trouble.append(f"the Lighthouse changed the quorum {max(ids) - 1} time(s)")
    samples: dict = {None: {}, rate: {}}
    windows: dict[int, tuple[str | None, list[float]]] = {}  # step times, by window
    for g in range(2):
        if codes[g] == 0:
            for w, setting, tag, value in steady(log_points(out / f"g{g}"), switches, margin):
                samples[setting].setdefault(tag, []).append(value)
                if tag == FIGURES[0]:
                    windows.setdefault(w, (setting, []))[1].append(value)
    trainer = (out / "g0" / "final_model.pt").exists()  # torchft's groups write none
    equal = codes == [0, 0] and same_model(out) if trainer else None
    return {"codes": codes, "trouble": trouble, "samples": samples, "equal": equal,
            "utilization": paired(windows), "quorums": said.count("Quorum! "),
            "switches": len(switches) - 1}  # fmt: skip


def training(log: Path) -> bool:
    """Whether the group's progress bar (or torchft's group) shows a step taken."""
    return bool(re.search(r"\| *[1-9]\d*/\d+ \[|^training$", log.read_text()[-4000:], re.M))


def log_points(run_dir: Path) -> list[tuple[float, dict[str, float]]]:
    """(wall time, figures of the interval it ends) of each log point of a group: the
    trainer's TensorBoard events, or the times a torchft group wrote."""
    times = run_dir / "times.jsonl"
    if times.exists():
        rows = [json.loads(line) for line in times.read_text().splitlines()]
        return [(b["t"], {FIGURES[0]: (b["t"] - a["t"]) / (b["step"] - a["step"]),
                          FIGURES[1]: b["bytes"]})
                for a, b in zip(rows[:-1], rows[1:], strict=True)]  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in FIGURES if t in acc.Tags()["scalars"]]
    if FIGURES[0] not in tags:
        return []
    values = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}
    return [(e.wall_time, {t: values[t][e.step] for t in tags if e.step in values[t]})
            for e in acc.Scalars(FIGURES[0])]  # fmt: skip


def steady(
    points: list[tuple[float, dict[str, float]]],
    switches: list[tuple[float, str | None]],
    margin: float,
) -> list[tuple[int, str | None, str, float]]:
    """(window, setting, figure, value) of each logging interval of a group run wholly
    under one setting of the link (window: how many switches came before it), from
    `margin` s before it began (a queue draining, a resend after the switch) to its end;
    not the first interval (the start-up) nor the last (DiLoCo's final sync of every
    fragment). An interval spans the wall times of two log points."""
    out = []
    for (began, _), (ended, values) in zip(points[:-2], points[1:-1], strict=True):
        if any(began - margin < t <= ended for t, _ in switches[1:]):
            continue  # the link changed during it
        before = [s for t, s in switches if t <= ended]
        out += [(len(before) - 1, before[-1], tag, v) for tag, v in values.items()]
    return out


def paired(windows: dict[int, tuple[str | None, list[float]]]) -> tuple[float, int] | None:
    """Utilization, window by window: the median step time of the unlimited windows on
    either side of a limited one over the limited one's, the median over the limited
    windows (and how many). Neighbours a few seconds apart share the machine's load,
    which drifts over a run by more than the link's cost on a shared machine."""
    ratios = []
    for w, (setting, steps) in windows.items():
        free = [statistics.median(windows[n][1]) for n in (w - 1, w + 1)
                if n in windows and windows[n][0] is None]  # fmt: skip
        if setting is not None and free:
            ratios.append(statistics.fmean(free) / statistics.median(steps))
    return (statistics.median(ratios), len(ratios)) if ratios else None


def same_model(out: Path) -> bool:
    import torch

    a, b = (torch.load(out / f"g{g}/final_model.pt", weights_only=True) for g in range(2))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def outer_syncs(steps: int, every: int, tau: int, fragments: int) -> int:
    """Syncs a run sends by [Note: the fragment schedule] (trainer/comm/diloco.py): one
    after each step k every - tau, then at the last step every fragment not applied there."""
    sent = (steps + tau) // every
    return sent + fragments - (1 if steps % every == 0 and sent else 0)


def figures(samples: dict[str, list[float]]) -> dict:
    """The median interval's step time (each interval holds whole syncs, so the median
    keeps their cost and drops other jobs' bursts on a shared machine), the mean bytes
    and wait, and how many intervals."""
    step, nbytes, wait = (samples.get(t) for t in FIGURES)
    return {
        "step": statistics.median(step) if step else None,
        "n": len(step or []),
        "bytes": statistics.fmean(nbytes) if nbytes else None,
        "wait": statistics.fmean(wait) if wait else None,
    }


def table(results: dict, diloco: set[str], measured: dict) -> list[str]:
    lines = ["| sync | link (measured a->b / b->a) | step time unlimited / limited "
             "(intervals) | utilization (limited windows) | bytes across / step | "
             "ft/wait_ms_per_step unlimited / limited | 1 - extra wait / step | "
             "outer syncs (at the limit) | timeouts, retries |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ms = lambda x, f=".0f": "-" if x is None else f"{x:{f}}"  # noqa: E731
    for name, per_rate in results.items():
        for rate, r in per_rate.items():
            free, slow = figures(r["samples"][None]), figures(r["samples"][rate])
            link = f"{rate} ({measured[rate][0]:.1f} / {measured[rate][1]:.1f} Mb/s)"
            if free["step"] is None or slow["step"] is None or r["utilization"] is None:
                lines.append(f"| {name} | {link} | no steady interval (exits {r['codes']}) "
                             "| | | | | | |")  # fmt: skip
                continue
            steps = (f"{1e3 * free['step']:.0f} ms ({free['n']}) / {1e3 * slow['step']:.0f} "
                     f"ms ({slow['n']})")  # fmt: skip
            nbytes = slow["bytes"] if slow["bytes"] is not None else free["bytes"]
            wait = f"{ms(free['wait'], '.1f')} / {ms(slow['wait'], '.1f')}"
            # the link's own share of a limited step: the wait it added (ms over s)
            bound = None
            if free["wait"] is not None and slow["wait"] is not None:
                bound = 1 - (slow["wait"] - free["wait"]) / (1e3 * slow["step"])
            syncs = f"{r['syncs']} ({slow['n'] // 2})" if name in diloco else "-"
            util = "{:.2f} ({})".format(*r["utilization"])
            lines.append(f"| {name} | {link} | {steps} | {util} | "
                         f"{ms(nbytes and nbytes / 1e3, '.1f')} kB | "
                         f"{wait if name in diloco else '-'} | {ms(bound, '.2f')} | {syncs} | "
                         f"{len(r['trouble'])} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it comes, also in a pipe
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit,10mbit", help="tbf rates, each against none")
    p.add_argument("--sync-steps", type=int, default=100, help="H")
    p.add_argument("--fragments", type=int, default=4, help="F")
    p.add_argument("--delays", default="1,5,12", help="tau: steps a sync runs behind (each)")
    p.add_argument("--torchft-delay", type=int, default=5, help="tau of torchft's DiLoCo")
    p.add_argument("--diloco-steps", type=int, default=1000, help="steps of a DiLoCo run")
    p.add_argument("--step-steps", type=int, default=300, help="steps of a per-step run")
    p.add_argument("--window", type=float, default=4.0, help="s between link switches")
    p.add_argument("--margin", type=float, default=0.5, help="s after a switch not counted")
    p.add_argument("--probe-mb", type=float, default=2.0, help="MB of the link's TCP probe")
    p.add_argument("--timeout", type=float, default=300, help="s a run may take")
    p.add_argument("--quick", action="store_true", help="smoke: H=20, 10mbit, few steps")
    p.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    p.add_argument("--no-torchft", dest="torchft", action="store_false",
                   help="leave out torchft's own DiLoCo (fp32)")  # fmt: skip
    for hidden in ("--torchft-group", "--lighthouse", "--host"):  # a torchft group's own
        p.add_argument(hidden, type=int if hidden == "--torchft-group" else str,
                       help=argparse.SUPPRESS)  # fmt: skip
    a = p.parse_args(argv)
    if a.torchft_group is not None:
        return torchft_group(a)
    if a.quick:
        a.rates, a.sync_steps, a.delays, a.diloco_steps, a.step_steps = "10mbit", 20, "2", 150, 150
        a.probe_mb, a.window, a.torchft_delay = 0.5, 3.0, 2
    rates = a.rates.split(",")
    every = a.sync_steps // a.fragments
    a.delays = [int(d) for d in a.delays.split(",")]
    taus = [*a.delays, a.torchft_delay]
    if a.sync_steps % a.fragments or not all(0 <= d < every for d in taus) or "none" in rates:
        why = "H a multiple of F, 0 <= tau < H/F, rates of tbf (each is run against none)"
        print(f"error: --sync-steps={a.sync_steps} --fragments={a.fragments} "
              f"--delays={a.delays} --rates={a.rates}: needs {why}", file=sys.stderr)  # fmt: skip
        return 2
    if a.out is not None and a.out.exists() and any(a.out.iterdir()):
        print(f"error: --out={a.out} is not empty: an earlier run's figures would mix with "
              "these; give a new or empty directory", file=sys.stderr)  # fmt: skip
        return 2
    out = a.out or Path(tempfile.mkdtemp(prefix="bench_diloco_"))
    net = Net()
    atexit.register(net.close)
    # the finally below runs on these too (Ctrl-C also where a shell started it ignoring it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _: sys.exit(128 + s))
    try:
        try:
            net.make()
            net.limit(rates[-1])  # tbf is in this kernel, or say so now
            net.limit(None)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"error: cannot make network namespaces and a tbf link here (needs root and "
                  f"iproute2 with tbf): {e}", file=sys.stderr)  # fmt: skip
            return 2
        try:
            return bench(net, a, rates, every, out)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted: removing its namespaces and processes", file=sys.stderr)
            return 130
    finally:
        net.close()


def bench(net: Net, a: argparse.Namespace, rates: list[str], every: int, out: Path) -> int:
    def trainer(args: list[str]) -> Launch:  # a group of this trainer: train.py
        return lambda g, url, host, run_dir: [
            sys.executable, "train.py", *JOB, *args, f"ft.replica_group={g}",
            f"ft.lighthouse={url}", f"ft.advertise_host={host}", f"hydra.run.dir={run_dir}",
        ]  # fmt: skip

    def torchft(tau: int) -> Launch:  # a group of torchft's DiLoCo: this script
        return lambda g, url, host, run_dir: [
            sys.executable, str(Path(__file__).resolve()), f"--torchft-group={g}",
            f"--lighthouse={url}", f"--host={host}", f"--out={run_dir}",
            f"--sync-steps={a.sync_steps}", f"--fragments={a.fragments}", f"--delays={tau}",
            f"--diloco-steps={a.diloco_steps}",
        ]  # fmt: skip

    # name: (launch, quorums the Lighthouse forms in a run, of which joins: not syncs)
    configs = {"per step, fp32": (trainer([f"train.steps={a.step_steps}", "train.log_every=1"]),
                                  a.step_steps, 0)}  # fmt: skip
    for tau in a.delays:
        for wire in ("fp32", "int8"):
            args = [f"train.steps={a.diloco_steps}", f"train.log_every={every}",
                    "ft.semi_sync=diloco", f"ft.sync_steps={a.sync_steps}",
                    f"ft.fragments={a.fragments}", f"ft.fragment_sync_delay={tau}",
                    f"ft.pseudo_grad_dtype={wire}"]  # fmt: skip
            syncs = outer_syncs(a.diloco_steps, every, tau, a.fragments)
            configs[f"diloco F={a.fragments} tau={tau}, {wire}"] = (trainer(args), syncs + 1, 1)
    if a.torchft:  # one quorum per sync, sent tau steps before its end; no final sync
        tau = a.torchft_delay
        syncs = (a.diloco_steps + tau) // every
        configs[f"torchft DiLoCo F={a.fragments} tau={tau}, fp32"] = (torchft(tau), syncs, 0)
    diloco = set(list(configs)[1:])
    print(f"run dirs under {out}; {' '.join(MODEL)}, batch 16 a group; H={a.sync_steps}: a "
          f"sync every {every} steps")  # fmt: skip
    nbytes, measured = int(a.probe_mb * 1e6), {}
    for rate in [None, *rates]:
        net.limit(rate)
        there = probe(net, "a", B_DATA, "b", nbytes, 60)
        back = probe(net, "b", A_DATA, "a", nbytes, 60)
        measured[rate] = (there, back)
        print(f"link {rate or 'unlimited'}: measured {there:.1f} Mb/s a->b, {back:.1f} "
              f"Mb/s b->a ({a.probe_mb:g} MB each way)")  # fmt: skip
    results: dict = {name: {} for name in configs}
    ok, port = True, 29600
    for name, (launch, quorums, joins) in configs.items():
        for rate in rates:
            port += 1
            t0 = time.monotonic()
            r = one_run(net, out / re.sub(r"\W+", "_", f"{name}_{rate}"), port, launch, rate, a)
            r["syncs"] = r["quorums"] - joins
            results[name][rate] = r
            ok &= r["codes"] == [0, 0] and r["equal"] is not False and not r["trouble"]
            ok &= r["quorums"] == quorums and r["utilization"] is not None  # else no figure
            n = {s: len(r["samples"][s].get(FIGURES[0], [])) for s in (None, rate)}
            print(f"{name} against {rate}: exits {r['codes']}, {r['switches']} switches, "
                  f"{n[None]} + {n[rate]} steady intervals (unlimited + {rate}), "
                  f"{r['quorums']} quorums ({quorums} expected), models equal {r['equal']}, "
                  f"{len(r['trouble'])} timeout/retry line(s), "
                  f"{time.monotonic() - t0:.0f} s")  # fmt: skip
            for line in r["trouble"][:5]:
                print(f"    {line[-200:]}")
    print()
    print("\n".join(table(results, diloco, measured)))
    for rate in rates:
        n = sum(results[name][rate]["syncs"] for name in diloco)
        bad = sum(len(results[name][rate]["trouble"]) for name in diloco)
        print(f"DiLoCo runs against {rate}: {n} outer syncs (about half of them at {rate}), "
              f"{bad} timeout/retry line(s) in their logs")  # fmt: skip
    return 0 if ok else 1


def torchft_group(a: argparse.Namespace) -> int:
    """Replica group a.torchft_group of torchft's own `torchft.local_sgd.DiLoCo` (the rows
    beside the trainer's): the same GPT and batch size on random tokens, AdamW inside (lr
    1e-3, the trainer's default), Nesterov SGD outside (0.7, 0.9), the blocks dealt into
    fragments strided as trainer/comm/diloco.py deals them, and the trainer's addresses
    (trainer/comm/addresses.py: torchft alone advertises the host name, which network
    namespaces share). Writes the wall time every sync period (H/F steps)."""
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from trainer.comm.addresses import AdvertisedHTTPTransport, bound_to
    from trainer.models.builtin import GPT

    torch.manual_seed(0)  # every group starts from the same weights (no heal at the start)
    model = GPT(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=64)
    fragments = [nn.ModuleList(list(model.blocks)[f :: a.fragments]) for f in range(a.fragments)]
    fragments[0].extend([model.wte, model.wpe, model.ln_f, model.lm_head])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in fragments]  # fmt: skip
    timeout = timedelta(seconds=30)
    store = torch.distributed.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=bound_to(a.host, ProcessGroupGloo)(timeout=timeout),
        load_state_dict=lambda sent: model.load_state_dict(sent["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=2, use_async_quorum=False, replica_id=f"torchft_diloco_{a.torchft_group}",
        lighthouse_addr=a.lighthouse, store_addr=a.host, store_port=store.port, rank=0,
        world_size=1, hostname=a.host, init_sync=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=60), heartbeat_interval=timedelta(milliseconds=100),
        checkpoint_transport=AdvertisedHTTPTransport(a.host, timeout),
    )  # fmt: skip
    seeded = torch.Generator().manual_seed(a.torchft_group)
    tokens = torch.randint(0, 64, (4096, 33), generator=seeded)
    every = a.sync_steps // a.fragments
    # what one rank sends in a 2-group AllReduce of fp32 (2 (n - 1) / n of it), as the
    # trainer counts it: a fragment's mean over the F, once in H/F steps
    sent = sum(4 * p.numel() for p in model.parameters()) / a.fragments / every
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "times.jsonl", "w") as times, DiLoCo(
        manager, fragments, inner, outer, sync_every=a.sync_steps,
        fragment_sync_delay=int(a.delays),
    ):  # fmt: skip
        for step in range(1, a.diloco_steps + 1):
            batch = tokens[torch.randint(0, 4096, (16,))]
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()  # DiLoCo's hooks: a fragment's quorum and send, or its sync
            if step == 1:
                print("training", flush=True)
            if step % every == 0:
                row = {"step": step, "t": time.time(), "bytes": sent}
                print(json.dumps(row), file=times, flush=True)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
