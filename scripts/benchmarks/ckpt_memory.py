"""Extra memory of a checkpoint save, a resume and a consolidation, per rank, measured from
outside torch: the anonymous resident set (RssAnon of /proc/self/status: every tensor,
every buffer of the process) sampled every millisecond in a thread, above its value just
before the operation: the tables of docs/checkpoints.md, "Memory", and of docs/bench.md,
"Checkpoints at Ψ = 202 M".

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc-per-node=2 \\
        scripts/benchmarks/ckpt_memory.py --mode zero --n-layer 4 --n-embd 512 --dir /tmp/ck
    ... --mode fsdp --resume-from /tmp/ck/zero/step_000001 --dir /tmp/ck   # a re-cut

With MALLOC_MMAP_THRESHOLD_ fixed ([Note: one mapping per tensor]) each rank builds a GPT
(vocabulary 256, 64 positions: Ψ ≈ 12 L d²), takes one AdamW step on random tokens, then:
`save` (checkpoint.save into --dir/<mode>; with --async an async save, [Note: async save]:
`save_stall_s` is how long training waits, the copy to the host, and `save_s` the whole
save up to its commit; sync: the two are the same; two saves, the second finding the host
copy allocated), or with --resume-from, `resume` (checkpoint.load into a freshly built
engine; its optimizer state, which a first step allocates too, is part of it: 8Ψ/P in
zero and fsdp, 8Ψ in ddp); rank 0 then `consolidate`s the checkpoint (the model once, 4Ψ)
and, with --export DIR, writes it as safetensors in shards of 100 MB (what export_hf.py
writes). Run it for two sizes and read the growth between them: fixed overheads cancel.
Prints one JSON line per rank.

`--fresh` and `--resume-from CKPT --step` compare a resume with a fresh start, as a run
sees it ([Note: a resume against a fresh start], with the commands).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


# [Note: one mapping per tensor]
# With MALLOC_MMAP_THRESHOLD_ fixed, every tensor above 64 kB is its own mapping, handed
# back to the kernel when freed, so the peak is what was alive at once.
class Peak:
    """RssAnon's highest value while the block runs, above its value at the start."""

    def __enter__(self) -> Peak:
        self.start = self.peak = rss_anon()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def mib(self) -> float:
        return round((self.peak - self.start) / 2**20, 1)


def _engine(args):  # -> (engine, the model's parameter count)
    from trainer.models.builtin import GPT
    from trainer.parallel import build_engine

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, eps=1e-3)
    options = {}
    if args.shard_group_size is not None:  # hybrid sharding (fsdp)
        options["shard_group_size"] = args.shard_group_size
    numel = sum(p.numel() for p in model.parameters())  # fsdp's module keeps only slices
    return build_engine(model, args.mode, adamw, **options), numel


# [Note: a resume against a fresh start]
# A resume against a fresh start, as a run sees it: `--fresh` builds the engine and takes
# two steps (`run_MiB`: the peak of build and steps, above RssAnon before the build), and
# `--resume-from CKPT --step` builds it, loads CKPT and takes two steps (`run_MiB`: the
# peak of all of it); the bound is the growth of their difference between two sizes. Two
# steps, since a fresh run's first runs its forward and backward before the optimizer
# state exists (its first `step()` allocates it): from the second on, every step of a
# fresh run holds what a resumed run holds from its first.
#
#     ... --mode zero --fresh --dir /tmp/ck                               # zero x 2 fresh
#     ... --mode zero --resume-from /tmp/ck/fsdp/step_000001 --step --dir /tmp/ck
#     ... --mode fsdp --shard-group-size 2 ...                            # hybrid
def _step(engine) -> None:
    """One AdamW step on random tokens (its first allocates the optimizer state)."""
    x = torch.randint(0, 256, (2, 64))
    logits = engine(x)
    engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()))
    engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="zero")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--export", type=Path, default=None, help="also export to this dir")
    parser.add_argument("--async", dest="in_background", action="store_true", help="async save")
    parser.add_argument("--shard-group-size", type=int, default=None, help="fsdp: hybrid")
    parser.add_argument("--fresh", action="store_true", help="build and two steps: run_MiB")
    parser.add_argument("--step", action="store_true", help="with --resume-from: two steps")
    args = parser.parse_args()
    if args.step and args.resume_from is None:
        parser.error("--step takes steps after --resume-from's load")

    from trainer import checkpoint, comm
    from trainer.run import dist as tdist

    torch.set_num_threads(1)
    env = tdist.init("gloo")
    comm.barrier(tag="measure").wait()
    run = Peak().__enter__()  # the whole run: build, [resume,] step
    engine, numel = _engine(args)
    out = {"rank": env.rank, "mode": args.mode, "world": env.world_size, "params": numel}
    if args.shard_group_size is not None:
        out["shard_group_size"] = args.shard_group_size
    if args.fresh:
        _step(engine)
        _step(engine)  # the steady step: the optimizer state alive through it
        run.__exit__()
        print(json.dumps(out | {"run": "fresh", "run_MiB": run.mib}), flush=True)
        tdist.shutdown()
        return
    if args.resume_from is None:
        _step(engine)
        run.__exit__()
        comm.barrier(tag="measure").wait()
        stalls, whole = [], []
        with Peak() as save:
            for step in (1, 2):  # the second save finds the host copy allocated
                t0 = time.perf_counter()
                path = checkpoint.save(
                    args.dir / args.mode, step, engine, in_background=args.in_background
                )
                stalls.append(round(time.perf_counter() - t0, 3))  # training goes on here
                checkpoint.finish_save()  # as if the steps until the next save took longer
                whole.append(round(time.perf_counter() - t0, 2))
        out |= {"save_MiB": save.mib, "save_s": whole, "save_stall_s": stalls}
        out |= {"async": args.in_background}
    else:
        path = args.resume_from
        comm.barrier(tag="measure").wait()
        t0 = time.perf_counter()
        with Peak() as load:
            checkpoint.load(path, engine)
        out |= {"resume_MiB": load.mib, "resume_s": round(time.perf_counter() - t0, 2)}
        if args.step:
            _step(engine)
            _step(engine)  # as --fresh
            run.__exit__()
            out |= {"run": "resumed", "run_MiB": run.mib}
        else:
            run.__exit__()
    comm.barrier(tag="measure").wait()
    if env.rank == 0:
        del engine
        t0 = time.perf_counter()
        with Peak() as whole:
            state = checkpoint.consolidate(path)
            del state
        out |= {"consolidate_MiB": whole.mib, "consolidate_s": round(time.perf_counter() - t0, 2)}
        if args.export is not None:  # as export_hf.py writes it, --max-shard-size 100MB
            from trainer.checkpoint.export import write_model

            t0 = time.perf_counter()
            with Peak() as export:
                write_model(path, args.export, lambda k: k, lambda keys: keys[:1], None, 10**8)
            out |= {"export_MiB": export.mib, "export_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out), flush=True)
    tdist.shutdown()


if __name__ == "__main__":
    main()
