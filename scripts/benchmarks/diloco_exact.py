"""This trainer's DiLoCo against torchft's own `torchft.local_sgd.DiLoCo` on the same batches:
the table of docs/fault_tolerance.md, "Against torchft's DiLoCo".

    python scripts/benchmarks/diloco_exact.py                # 40 s of CPU, 1-2 min on 2 busy cores
    python scripts/benchmarks/diloco_exact.py --md table.md  # the table also as a file

Two one-rank replica groups trained both ways from the same initial model, per inner
optimizer (SGD without momentum; AdamW, eps 1e-3): (a) `train.py` per group, ft.semi_sync=
diloco, H steps a round, one fragment, no delay, no mix, fp32 wire; (b) this script per
group (--torchft-group): torchft's Manager (a Lighthouse of its own) and DiLoCo over the same
MLP, the same initial weights, the batches the trainer's sampler deals that group at each
step, the same inner optimizer and an outer Nesterov SGD of the same lr and momentum. Every
process runs one torch thread. Then (a)'s final model (the global copy after the last sync)
is held against (b)'s, tensor by tensor ([Note: what may differ, and by how much]). The
initial weights (b) starts from are checked bitwise against the global copy the trainer
checkpoints before its first sync. Exits 1 where a run fails, the initial weights or the
groups of one side differ, torchft committed another number of syncs, or a tensor is
beyond the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
GROUPS = 2
# inner optimizer: (the trainer's overrides, the same optimizer as torch builds it)
INNER: dict[str, tuple[list[str], type, dict[str, Any]]] = {
    "sgd": (["optim=sgd", "optim.lr=0.05", "optim.momentum=0"], torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.0}),
    "adamw": (["optim=adamw", "optim.lr=1e-3", "optim.eps=1e-3", "optim.weight_decay=0.01",
               "optim.fused=true"], torch.optim.AdamW,
              {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01, "fused": True}),
}  # fmt: skip
# [Note: what may differ, and by how much]
# Both sides run the same fp32 operations: the same model, batch and inner optimizer step
# at each step, Δ = θ - θ_g, and torch's SGD (Nesterov) as the outer step of the mean Δ.
# The mean is reached two ways, to the same number: the trainer sums w Δ over the groups
# and divides by Σ w (w = H slots each: H steps of one slot), torchft sums Δ and divides
# by its participants (2). With H a power of two, scaling by w and dividing by 2w or 2 are
# exact in binary floating point, and a sum of two terms is the same in either order (a +
# b = b + a in IEEE arithmetic), so the means are bitwise equal (at H = 3 they round
# apart: 2.7e-7 of max |θ| at S = 12, no tensor bitwise equal). torch's first momentum
# step sets its buffer to the gradient, the trainer's buffer starts at zeros: 0.9 * 0 +
# g = g, exactly. Left is what neither side fixes: the order a kernel (a matmul, the cross
# entropy) sums in, the same for the same shapes, strides and one thread. So the claim is
# bitwise equality, and the bound is what another order could cost, to first order: a
# value summed from at most K = 256 terms (the hidden width; the batch is 32) moves by at
# most (K - 1) u of the sum of their magnitudes (u = 2^-24), about K ulps of the value;
# each of the S inner steps adds at most that, and the outer step (lr 0.7, Nesterov factor
# 1 + 0.9) scales what has built up by less than 2: under 2 S K u of the tensor's largest
# value, 3.7e-4 at S = 12. An outer momentum of 0.8 on torchft's side moves the models
# 2.8e-2 (AdamW) to 5.6e-2 (SGD) apart.
SUMMED = 256  # K: the longest sum behind a value (the MLP's hidden width)


def bound(steps: int) -> float:
    """Max |a - b| / max |b| a tensor may show ([Note: what may differ, and by how much])."""
    return 2 * steps * SUMMED * 2.0**-24


def trainer_args(steps: int, every: int, inner: str) -> list[str]:
    """The overrides of one group's `train.py` (a, and the config (b) is built from)."""
    # AdamW's run checkpoints the step before the first sync, whose global copy is θ0
    # (inner SGD without momentum builds no optimizer state, where the global copy lives:
    # its checkpoints hold none)
    ckpt = [f"ckpt.every={every - 1}", "ckpt.keep=0"] if checks_theta0(every, inner) else []
    ckpt = ckpt or ["ckpt.every=0"]
    return [
        "model=mlp", "data=synthetic", "mode=ddp", "precision=fp32", "seed=0",
        "train.batch_size=64", f"train.steps={steps}", f"train.log_every={every}",
        "train.eval_every=0", "optim.schedule=constant", "optim.warmup_steps=0",
        "optim.clip_grad_norm=0", *INNER[inner][0], *ckpt, "ft.enabled=true",
        f"ft.replica_groups={GROUPS}", "ft.timeout_s=60", "ft.heartbeat_ms=100",
        "ft.semi_sync=diloco", f"ft.sync_steps={every}", "ft.fragments=1",
        "ft.fragment_sync_delay=0", "ft.fragment_update_alpha=0", "ft.pseudo_grad_dtype=fp32",
        f"ft.outer_lr={OUTER_LR}", f"ft.outer_momentum={OUTER_MOMENTUM}",
    ]  # fmt: skip


def checks_theta0(every: int, inner: str) -> bool:
    return inner == "adamw" and every > 1


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.config import schema  # noqa: F401  (registers the config's types)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides)


def setup(cfg: Any, steps: int) -> tuple[torch.nn.Module, dict[int, list]]:
    """The trainer's initial model (built on meta, given values by SeededInit(seed), as
    train.py builds it) and the batches each group takes at steps 1..steps: its sampler
    (slot g of 2) and `SlotBatches.take` for the slots the quorum of both deals it."""
    from trainer.comm.replicas import slots_of
    from trainer.data.datasets import SlotBatches, make_loader
    from trainer.models.build import model_and_data
    from trainer.models.materialize import SeededInit, empty_weights, materialize

    with empty_weights():
        model, dataset, _ = model_and_data(cfg, ("mlp", "synthetic"))
    materialize(model, SeededInit(cfg.seed), "cpu")
    batches = {}
    for g in range(GROUPS):
        loader = make_loader(dataset, cfg.train.batch_size, g, GROUPS, cfg.seed)
        take = SlotBatches(loader, rank=0, ranks_per_group=1).take
        slots = slots_of(g, list(range(GROUPS)), GROUPS)
        batches[g] = [take(step, slots) for step in range(1, steps + 1)]
    return model, batches


def global_copy(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The global copy a checkpoint of the trainer's DiLoCo holds (the optimizer state's
    `outer_global`, laid out as the parameters), by parameter name."""
    from trainer.checkpoint.recutting import Checkpoint

    ckpt = Checkpoint(checkpoint)
    try:
        ckpt.open({0})
        out = {}
        for group in ckpt.layout["groups"]:
            for name, shape in zip(group["names"], group["shapes"], strict=True):
                value = torch.empty(shape, dtype=torch.float32)
                flat = value.view(-1)
                for r, j, src, dst, n in ckpt.copies(name, 0, flat.numel(), 0):
                    ckpt.read(r, f"optim/{j}/outer_global", src, flat[dst : dst + n], n)
                out[name] = value
        return out
    finally:
        ckpt.close()


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per tensor: max |a - b| and that over max |b|; the worst of each, and how many are
    bitwise equal."""
    if a.keys() != b.keys():
        raise RuntimeError(f"the models' keys differ: {sorted(a.keys() ^ b.keys())}")
    rows = {}
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item()
        rows[k] = (diff, diff / max(b[k].abs().max().item(), 1e-30), torch.equal(a[k], b[k]))
    return {
        "tensors": len(rows),
        "elements": sum(t.numel() for t in a.values()),
        "bitwise": sum(eq for *_, eq in rows.values()),
        "abs": max(d for d, *_ in rows.values()),
        "rel": max(r for _, r, _ in rows.values()),
        "per_tensor": rows,
    }


def same(models: list[dict[str, torch.Tensor]]) -> bool:
    return all(m.keys() == models[0].keys() and all(torch.equal(m[k], models[0][k]) for k in m)
               for m in models[1:])  # fmt: skip


def clean_env() -> dict[str, str]:
    """This environment without a fault schedule or a rank; one torch thread, torchft quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDTRAIN_FAULT", "RANK"))}
    return {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RUST_LOG": "warn"}


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        p = subprocess.Popen(argv, cwd=ROOT, env=clean_env(), stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
    p.log = log
    return p


def lighthouse() -> tuple[Any, str]:
    """torchft's Lighthouse in this process, on the loopback address: both groups of one
    side. A generous heartbeat timeout: a quorum without a group on this busy machine would
    change what is computed (its slots dealt to the other), not time anything."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=GROUPS, join_timeout_ms=60_000,
                              quorum_tick_ms=10, heartbeat_timeout_ms=10_000)  # fmt: skip
    return server, "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]


def run_both(a: argparse.Namespace, inner: str, out: Path, model: torch.nn.Module,
             batches: dict[int, list]) -> dict[str, Any]:  # fmt: skip
    """Both sides' groups at once, each side through its own Lighthouse; their final
    models, and torchft's commits."""
    out.mkdir(parents=True)
    servers, procs = [], []
    try:
        for _ in "ab":
            servers.append(lighthouse())
        (_, url_a), (_, url_b) = servers
        for g in range(GROUPS):
            argv = [sys.executable, "train.py", *trainer_args(a.steps, a.sync_steps, inner),
                    f"ft.replica_group={g}", f"ft.lighthouse={url_a}",
                    f"hydra.run.dir={out / f'trainer_g{g}'}"]  # fmt: skip
            procs.append(start(argv, out / f"trainer_g{g}.log"))
        for g in range(GROUPS):
            torch.save({"model": model, "batches": batches[g]}, out / f"setup_g{g}.pt")
            argv = [sys.executable, str(Path(__file__).resolve()), f"--torchft-group={g}",
                    f"--lighthouse={url_b}", f"--inner={inner}", f"--out={out}",
                    f"--sync-steps={a.sync_steps}"]  # fmt: skip
            procs.append(start(argv, out / f"torchft_g{g}.log"))
        deadline = time.monotonic() + a.timeout
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for server, _ in servers:
            server.shutdown()
    failed = [p for p in procs if p.returncode != 0]
    for p in failed:
        print(f"{p.log.name} exited {p.returncode}:\n{p.log.read_text()[-3000:]}", file=sys.stderr)
    if failed:
        raise RuntimeError(f"{inner}: {len(failed)} of the {len(procs)} groups failed")

    def load(path: Path) -> dict[str, torch.Tensor]:
        return torch.load(path, map_location="cpu", weights_only=True)

    trainer = [load(out / f"trainer_g{g}" / "final_model.pt") for g in range(GROUPS)]
    torchft = [load(out / f"torchft_g{g}.pt") for g in range(GROUPS)]
    commits = [json.loads((out / f"torchft_g{g}.json").read_text()) for g in range(GROUPS)]
    return {"trainer": trainer, "torchft": torchft, "commits": commits}


def table(results: dict[str, dict[str, Any]], steps: int) -> list[str]:
    lines = [
        f"| inner optimizer | tensors (values) | bitwise equal | max \\|a - b\\| | "
        f"max \\|a - b\\| / max \\|b\\| | bound (S = {steps}) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"sgd": "SGD, lr 0.05, no momentum", "adamw": "AdamW, lr 1e-3, eps 1e-3, wd 0.01"}
    for inner, r in results.items():
        lines.append(f"| {names[inner]} | {r['tensors']} ({r['elements']:,}) | "
                     f"{r['bitwise']} of {r['tensors']} | {r['abs']:.1e} | {r['rel']:.1e} | "
                     f"{bound(steps):.1e} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="S: inner steps (a multiple of H)")
    p.add_argument("--sync-steps", type=int, default=4, help="H: steps of a round")
    p.add_argument("--inner", default="sgd,adamw", help="inner optimizers (each a row)")
    p.add_argument("--md", type=Path, default=None, help="also write the table here")
    p.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=180, help="s both sides may take")
    p.add_argument("--torchft-group", type=int, help=argparse.SUPPRESS)  # (b)'s own
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torchft_group is not None:
        return torchft_group(a)
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouses in this process: quorums unsaid
    inners = a.inner.split(",")
    if (
        a.steps % max(a.sync_steps, 1)
        or not 1 <= a.sync_steps <= a.steps
        or not (set(inners) <= set(INNER))
    ):
        print(f"error: --steps={a.steps} --sync-steps={a.sync_steps} --inner={a.inner}: needs "
              f"H >= 1, S a multiple of H (both sides end at a sync), inner optimizers of "
              f"{','.join(INNER)}", file=sys.stderr)  # fmt: skip
        return 2
    if a.out is not None and a.out.exists() and any(a.out.iterdir()):
        print(f"error: --out={a.out} is not empty; give a new or empty directory", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="diloco_exact_") as tmp:
        out = a.out or Path(tmp)
        results, ok = {}, True
        for inner in inners:
            cfg = compose(trainer_args(a.steps, a.sync_steps, inner))
            for k, v in INNER[inner][2].items():  # the trainer's optimizer is (b)'s
                if cfg.optim[k] != v:
                    print(f"error: optim.{k}={cfg.optim[k]} in the trainer, {v} in torchft's "
                          "groups", file=sys.stderr)  # fmt: skip
                    return 2
            model, batches = setup(cfg, a.steps)
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            try:
                r = run_both(a, inner, out / inner, model, batches)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            checks = {
                "trainer's groups bitwise equal": same(r["trainer"]),
                "torchft's groups bitwise equal": same(r["torchft"]),
                f"torchft committed {a.steps // a.sync_steps} syncs": all(
                    c["commits"] == a.steps // a.sync_steps for c in r["commits"]
                ),
            }
            if checks_theta0(a.sync_steps, inner):
                ckpt = out / inner / "trainer_g0" / "checkpoints" / f"step_{a.sync_steps - 1:06d}"
                checks["initial weights bitwise the trainer's"] = same([initial, global_copy(ckpt)])
            c = compare(r["trainer"][0], r["torchft"][0])
            checks[f"within the bound {bound(a.steps):.1e}"] = c["rel"] <= bound(a.steps)
            for k, (d, rel, eq) in c["per_tensor"].items():
                if not eq:
                    print(f"{inner} {k}: max |a - b| {d:.2e}, / max |b| {rel:.2e}")
            for what, good in checks.items():
                print(f"{inner}: {what}: {'yes' if good else 'NO'}")
                ok &= good
            results[inner] = c
    lines = table(results, a.steps)
    print("\n".join(lines))
    print(f"({time.monotonic() - t0:.0f} s)")
    if a.md is not None:
        a.md.write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def torchft_group(a: argparse.Namespace) -> int:
    """Replica group a.torchft_group of torchft's DiLoCo: the model and batches this
    script's parent took from the trainer, a plain loop of forward, loss, backward and the
    inner step (DiLoCo's hooks on it sync every H steps). Writes the final model and the
    number of syncs committed."""
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from trainer.comm.addresses import AdvertisedHTTPTransport, bound_to
    from trainer.models.loss import loss_fn

    g, host = a.torchft_group, "127.0.0.1"
    setup = torch.load(a.out / f"setup_g{g}.pt", weights_only=False)  # this script's own file
    model, batches = setup["model"], setup["batches"]
    _, cls, kwargs = INNER[a.inner]
    inner = cls(model.parameters(), **kwargs)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                            nesterov=True)  # fmt: skip
    timeout = timedelta(seconds=60)
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    # init_sync=False: both groups start from the same weights, nothing to heal at step 0
    manager = Manager(
        pg=bound_to(host, ProcessGroupGloo)(timeout=timeout),
        load_state_dict=lambda sent: model.load_state_dict(sent["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=GROUPS, use_async_quorum=False, replica_id=f"torchft_diloco_{g}",
        lighthouse_addr=a.lighthouse, store_addr=host, store_port=store.port, rank=0,
        world_size=1, hostname=host, init_sync=False, timeout=timeout, quorum_timeout=timeout,
        heartbeat_interval=timedelta(milliseconds=100),
        checkpoint_transport=AdvertisedHTTPTransport(host, timeout),
    )  # fmt: skip
    with DiLoCo(
        manager, [model], inner, outer, sync_every=a.sync_steps, fragment_sync_delay=0,
        fragment_update_alpha=0.0, should_quantize=False,
    ):  # fmt: skip
        for x, y in batches:
            inner.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            inner.step()
    torch.save(model.state_dict(), a.out / f"torchft_g{g}.pt")
    commits = {"commits": manager.current_step(), "batches": len(batches)}
    (a.out / f"torchft_g{g}.json").write_text(json.dumps(commits))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
