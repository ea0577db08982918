"""mode.offload=disk measured (the tables of docs/offload.md and the last of docs/bench.md):
the host step, memory and step time against offload=null, and a model too big for memory.

    python scripts/benchmarks/bench_offload.py host-step --params 25e6,200e6 --deepspeed-python PY
    python scripts/benchmarks/bench_offload.py memory --nproc 2,4 --modes zero,fsdp --params 200e6
    python scripts/benchmarks/bench_offload.py headline --layers 26 --embd 2560 --steps 4

host-step: torch's fused CPU AdamW (what the offloaded step runs, one buffer at a time)
against DeepSpeed's DeepSpeedCPUAdam on the same tensors, side by side in rounds (its
cpu_adam op is built the first time, about 2.5 min of g++). DeepSpeed runs in a Python of
its own (`--deepspeed-python`, a scratch venv with deepspeed installed): it is not a
dependency of the trainer. Both with the same number of threads.

memory: for each mode and P, the same MLP (`--params` elements, `--width` wide) trained
with offload=null and offload=disk, each in a fresh torchrun group (a peak is a process's
own). Per rank, sampled every 2 ms from /proc/self/status during the timed steps: the peak
anonymous memory (RssAnon: the heap, i.e. tensors) as a fraction of 16Ψ, and the page
cache the offload file holds (fincore) beside it. The step time is the slowest rank's
median; the floor is max(the offload=null step, this disk's time to read and write the
bytes the step moves), the disk measured in the same run on a file of the same size.

headline: a GPT (`--layers` x `--embd`) trained for `--steps` steps in one process with
offload=disk (zero, fp32, AdamW), the states several times what the step keeps in memory;
loss, step time and peak RssAnon against the estimator's figure for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.bench import launch  # noqa: E402

GiB = 2**30


# -- what a process holds --------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The largest RssAnon, and the largest C heap in use (glibc's mallinfo2: the live
    tensors' bytes, whatever the heap keeps beside them), seen by a thread sampling every
    `every_s` while `on`."""

    def __init__(self, every_s: float = 0.002):
        from trainer.observe import heap

        self.every_s, self.on, self.high, self.heap_high = every_s, False, 0, 0
        self._heap = heap.heap_bytes if heap.available() else lambda: 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.on:
                self.high = max(self.high, _status("RssAnon"))
                self.heap_high = max(self.heap_high, self._heap())
            time.sleep(self.every_s)

    def stop(self) -> int:
        self._stop = True
        self._thread.join()
        return self.high


def cached_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (util-linux fincore), -1 where unknown."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", str(path)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(out.stdout.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return -1


def disk_speed(directory: Path, nbytes: int, chunk: int = 64 * 2**20) -> tuple[float, float]:
    """(read, write) bytes/s of the offload file's own I/O (pwrite, then preadv, each with
    its page cache dropped), on a file of `nbytes` in `directory`."""
    from trainer.offload.disk import OffloadFile

    f = OffloadFile(directory / "speed.offload", nbytes)
    try:
        buf = torch.ones(chunk // 4)
        start = time.perf_counter()
        for off in range(0, nbytes - chunk + 1, chunk):
            f.write(buf, off)
        os.fsync(f.fd)
        write = (nbytes // chunk * chunk) / (time.perf_counter() - start)
        start = time.perf_counter()
        for off in range(0, nbytes - chunk + 1, chunk):
            f.read(buf, off)
        read = (nbytes // chunk * chunk) / (time.perf_counter() - start)
    finally:
        f.close()
    return read, write


# -- host-step ---------------------------------------------------------------------------------

DS_STEP = r"""
import json, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n, steps, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
p = torch.nn.Parameter(torch.randn(n))
p.grad = torch.randn(n)
opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
opt.step()
times = []
for _ in range(steps):
    t = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def _torch_step(n: int, steps: int, threads: int) -> list[float]:
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def host_step(args: argparse.Namespace) -> dict:
    rows = {}
    for n in [int(float(v)) for v in args.params.split(",")]:
        ours, theirs = [], []
        for _ in range(args.rounds):  # side by side, alternating
            ours += _torch_step(n, args.steps, args.threads)
            if args.deepspeed_python:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                out = subprocess.run(
                    [args.deepspeed_python, "-c", DS_STEP, str(n), str(args.steps),
                     str(args.threads)],
                    capture_output=True, text=True, env=env, check=True,
                )  # fmt: skip
                theirs += json.loads(out.stdout.strip().splitlines()[-1])
        row = {"torch_fused_ns_per_param": statistics.median(ours) / n * 1e9}
        if theirs:
            row["deepspeed_cpu_adam_ns_per_param"] = statistics.median(theirs) / n * 1e9
            row["speed_vs_deepspeed"] = (
                row["deepspeed_cpu_adam_ns_per_param"] / row["torch_fused_ns_per_param"]
            )
        rows[str(n)] = row
        print(n, json.dumps(row), flush=True)
    return rows


# -- memory (one torchrun group per contender) ---------------------------------------------------


def _mlp_shape(params: float, width: int) -> int:
    return max(1, round(params / (width * width)))


def worker(args: argparse.Namespace) -> None:
    """One contender on this torchrun group; rank 0 writes every rank's figures."""
    from trainer import comm
    from trainer.models.builtin import MLP
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.observe import heap
    from trainer.parallel import build_engine
    from trainer.run import dist as tdist

    heap.keep_freed_pages()  # as train.py runs: [Note: keeping freed pages]
    env = tdist.init("gloo")
    torch.set_num_threads(1)
    peak = Peak()
    baseline = _status("RssAnon")  # torch and the group, before any of the model
    depth = _mlp_shape(args.params, args.width)
    with empty_weights():  # every mode builds what it keeps only (fsdp: its slices)
        model = MLP(in_dim=args.width, hidden=args.width, depth=depth)
    psi = sum(p.numel() for p in model.parameters())
    directory = Path(args.dir)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4, eps=1e-3, fused=True)  # noqa: E731
    engine = build_engine(
        model, args.mode, opt, source=SeededInit(0), bucket_mb=25.0,
        offload=args.offload, offload_dir=directory / "offload",
    )  # fmt: skip
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    times, cache, waits = [], 0, []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            peak.on = True
        comm.barrier().wait()
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(engine(x), y).backward()
        engine.step()
        times.append(time.perf_counter() - t)
        if i >= args.warmup and engine.offload is not None:
            cache = max(cache, cached_bytes(engine.offload.file.path))
            waits.append(engine.offload.last_step["wait_s"])
    high = peak.stop()
    moved = engine.offload.last_step["bytes"] if engine.offload is not None else 0
    figures = [*times[args.warmup :], high, cache, moved, baseline, peak.heap_high]
    mine = torch.tensor(figures, dtype=torch.float64)
    every = torch.empty(env.world_size * mine.numel(), dtype=torch.float64)
    with comm.unaccounted():
        comm.all_gather(every, mine, tag="bench").wait()
    engine.close()
    if env.rank == 0:
        rows = every.view(env.world_size, -1)
        step = rows[:, : args.steps].max(0).values
        out = {
            "psi": psi,
            "step_s": statistics.median(step.tolist()),
            "anon_peak_bytes": rows[:, args.steps].tolist(),
            "file_cached_bytes": rows[:, args.steps + 1].tolist(),
            "moved_bytes_per_step": rows[:, args.steps + 2].tolist(),
            "anon_before_model_bytes": rows[:, args.steps + 3].tolist(),
            "heap_peak_bytes": rows[:, args.steps + 4].tolist(),
            "offload_wait_s": statistics.median(waits) if waits else 0.0,
        }
        Path(args.out).write_text(json.dumps(out))
    tdist.shutdown()


def memory(args: argparse.Namespace) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        scratch_dir = Path(scratch)
        for nproc in [int(v) for v in args.nproc.split(",")]:
            for mode in args.modes.split(","):
                for offload in (None, "disk"):
                    name = f"{mode} P={nproc} offload={offload or 'null'}"
                    out = scratch_dir / "out.json"
                    cmd = [
                        "worker", "--mode", mode, "--params", str(args.params), "--width",
                        str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--dir", str(scratch_dir), "--out", str(out),
                    ] + (["--offload", offload] if offload else [])  # fmt: skip
                    if launch(__file__, nproc, cmd) != 0:
                        raise SystemExit(f"{name}: the run failed")
                    row = json.loads(out.read_text())
                    results[name] = row
                    print(name, _memory_line(row), flush=True)
            # this disk, measured in the same run, on a file as large as a rank's
            biggest = max(r.get("moved_bytes_per_step", [0])[0] for r in results.values()) // 2
            read, write = disk_speed(scratch_dir, max(biggest, GiB))
            results[f"disk P={nproc}"] = {"read_Bps": read, "write_Bps": write}
            print(f"disk: read {read / 1e9:.2f} GB/s, write {write / 1e9:.2f} GB/s", flush=True)
    return results


def _memory_line(row: dict) -> str:
    sixteen = 16 * row["psi"]
    anon = max(row["anon_peak_bytes"]) / sixteen
    above = max(_above(row)) / sixteen
    return (
        f"step {row['step_s']:.3f} s, peak anon {anon:.3f} of 16Psi ({above:.3f} above the "
        f"process before the model; heap in use {max(row['heap_peak_bytes']) / sixteen:.3f}; "
        f"Psi={row['psi']:,}), "
        f"file cached {max(row['file_cached_bytes']) / 2**20:.0f} MiB, moved "
        f"{max(row['moved_bytes_per_step']) / 1e9:.2f} GB/step, "
        f"waited {row['offload_wait_s']:.3f} s"
    )


def _above(row: dict) -> list[float]:
    return [
        a - b for a, b in zip(row["anon_peak_bytes"], row["anon_before_model_bytes"], strict=True)
    ]


def markdown(results: dict) -> str:
    head = ["run", "step s", "disk / null", "floor s", "step / floor", "peak anon / 16Ψ",
            "above the process before the model", "offload file in page cache"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in results.items():
        if name.startswith("disk"):
            continue
        mode_p = name.rsplit(" offload=", 1)[0]
        null = results[f"{mode_p} offload=null"]
        nproc = mode_p.split("P=")[1]
        disk = results[f"disk P={nproc}"]
        # every rank's bytes go to this one disk, reads and writes one after the other
        moved = sum(row["moved_bytes_per_step"])
        io = moved / 2 / disk["read_Bps"] + moved / 2 / disk["write_Bps"]
        floor = max(null["step_s"], io)
        anon = max(row["anon_peak_bytes"]) / (16 * row["psi"])
        above = max(_above(row)) / (16 * row["psi"])
        cached = max(row["file_cached_bytes"])
        offloaded = "offload=disk" in name
        lines.append(
            f"| {name} | {row['step_s']:.2f} | {row['step_s'] / null['step_s']:.2f} | "
            f"{floor:.2f} | {row['step_s'] / floor:.2f} | {anon:.3f} | {above:.3f} | "
            f"{f'{cached / 2**20:.0f} MiB' if offloaded else '-'} |"
        )
    for name, row in results.items():
        if name.startswith("disk"):
            lines.append(
                f"\n{name}: read {row['read_Bps'] / 1e9:.2f} GB/s, "
                f"write {row['write_Bps'] / 1e9:.2f} GB/s"
            )
    return "\n".join(lines)


# -- headline ------------------------------------------------------------------------------------


def headline(args: argparse.Namespace) -> dict:
    """One process: a GPT whose states exceed this machine's memory, offload=disk."""
    from trainer.models.builtin import GPT
    from trainer.models.materialize import SeededInit, empty_weights
    from trainer.parallel import build_engine
    from trainer.run import dist as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577", RANK="0", WORLD_SIZE="1")
    tdist.init("gloo")
    torch.set_num_threads(args.threads)
    peak = Peak(0.01)
    peak.on = True
    vocab, block = 65, args.block
    with empty_weights():
        model = GPT(vocab_size=vocab, block_size=block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)  # fmt: skip
    psi = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} x {args.embd}: {psi:,} parameters, 16Psi = {16 * psi / 1e9:.1f} GB")
    opt = lambda ps: torch.optim.AdamW(ps, lr=args.lr, fused=True)  # noqa: E731
    start = time.perf_counter()
    engine = build_engine(model, "zero", opt, source=SeededInit(0),
                          offload="disk", offload_dir=Path(args.dir) / "offload")  # fmt: skip
    built = time.perf_counter() - start
    print(f"built in {built:.0f} s; offload file {engine.offload.nbytes / 1e9:.1f} GB", flush=True)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (args.batch, block + 1), generator=g)  # one batch, learnt
    losses, times = [], []
    for step in range(args.steps):
        t = time.perf_counter()
        logits = engine(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
        loss.backward()
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        print(
            f"step {step + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s (waited "
            f"{engine.offload.last_step['wait_s']:.1f} s for the file), peak anon "
            f"{peak.high / 1e9:.2f} GB",
            flush=True,
        )
    engine.close()
    return {
        "params": psi,
        "sixteen_psi_bytes": 16 * psi,
        "losses": losses,
        "step_s": times,
        "anon_peak_bytes": peak.stop(),
        "build_s": built,
    }


# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("host-step")
    h.add_argument("--params", default="25e6,200e6")
    h.add_argument("--steps", type=int, default=5)
    h.add_argument("--rounds", type=int, default=3)
    h.add_argument("--threads", type=int, default=1)
    h.add_argument("--deepspeed-python", help="a Python with deepspeed installed")
    for name in ("memory", "worker"):
        m = sub.add_parser(name)
        m.add_argument("--params", type=float, default=200e6)
        m.add_argument("--width", type=int, default=4096)
        m.add_argument("--batch", type=int, default=8)
        m.add_argument("--steps", type=int, default=3)
        m.add_argument("--warmup", type=int, default=1)
        m.add_argument("--dir", default=str(ROOT / "runs"))
        if name == "memory":
            m.add_argument("--nproc", default="2,4")
            m.add_argument("--modes", default="zero,fsdp")
        else:
            m.add_argument("--mode", required=True)
            m.add_argument("--offload")
            m.add_argument("--out", required=True)
    g = sub.add_parser("headline")
    g.add_argument("--layers", type=int, default=26)
    g.add_argument("--embd", type=int, default=2560)
    g.add_argument("--heads", type=int, default=20)
    g.add_argument("--block", type=int, default=32)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--steps", type=int, default=4)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--dir", default=str(ROOT / "runs"))
    for p in (h, g, sub.choices["memory"]):
        p.add_argument("--out", type=Path, dest="json_out")
        p.add_argument("--md", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.what == "worker":
        worker(args)
        return
    result = {"host-step": host_step, "memory": memory, "headline": headline}[args.what](args)
    text = markdown(result) if args.what == "memory" else json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
