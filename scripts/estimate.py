"""Will it fit, and how fast? Memory per rank, traffic and step time of every mode for a
model and a cluster, before launching anything (the model is never allocated).

    python scripts/estimate.py model=gpt model.n_layer=48 model.n_embd=1600 precision=bf16
    python scripts/estimate.py --world-size 16 --shard-group-size 8 model=gpt ...
    python scripts/estimate.py --params 7.5e9 --world-size 64 precision=bf16 mode.reduce_dtype=bf16
    python scripts/estimate.py --replica-groups 4 --across-gbps 1.25 ft.semi_sync=diloco ...
    python scripts/estimate.py --json ...

Arguments without dashes are train.py's Hydra overrides (`mode=zero` estimates that mode
only); the options describe the cluster. Defaults: one node of 8 H100 80 GB (NVLink,
one 400 Gb/s InfiniBand NIC per GPU). How each figure is computed: trainer/estimate/.

Replica groups (`--replica-groups N`: N groups of --world-size ranks, ft.enabled=true) add
the traffic between them: every step an AllReduce of each rank's gradients, or with
ft.semi_sync=diloco|local_sgd one fragment's pseudo-gradient every ft.sync_steps /
ft.fragments steps (ft.pseudo_grad_dtype on the wire, hidden behind
ft.fragment_sync_delay steps); bytes per rank and step, and the seconds a step waits on
the link between groups (--across-gbps), in step s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.errors import ConfigError  # noqa: E402
from trainer.estimate import Cluster, compose_modes, estimate  # noqa: E402
from trainer.estimate.replica_groups import groups_of  # noqa: E402
from trainer.estimate.report import table, to_json  # noqa: E402
from trainer.estimate.run import peak_flops  # noqa: E402
from trainer.parallel.precision import Precision  # noqa: E402
from trainer.run.cli import check_group_choices, fail  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--world-size", type=int, default=8, help="ranks P (default 8)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (8)")
    parser.add_argument(
        "--shard-group-size", type=int, help="S for zero and fsdp: shard within groups of S ranks"
    )
    parser.add_argument(
        "--params",
        type=float,
        help="a bare parameter count instead of the model (7.5e9): model states and traffic only",
    )
    parser.add_argument("--device-gb", type=float, default=80.0, help="memory per device, GB (80)")
    parser.add_argument(
        "--intra-gbps",
        type=float,
        default=450.0,
        help="GB/s (bytes) a rank sends inside its node (450: NVLink 4, one way)",
    )
    parser.add_argument(
        "--inter-gbps",
        type=float,
        default=50.0,
        help="GB/s (bytes) a rank sends to other nodes (50: one 400 Gb/s NIC per GPU)",
    )
    parser.add_argument(
        "--replica-groups",
        type=int,
        help="N replica groups of --world-size ranks each, as ft.replica_groups=N (1: "
        "nothing crosses groups); ft.* overrides set how they sync",
    )
    parser.add_argument(
        "--across-gbps",
        type=float,
        default=0.125,
        help="GB/s (bytes) a rank sends to the other replica groups, one way (0.125: 1 Gb/s)",
    )
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (0.4)")
    parser.add_argument(
        "--disk-read-gbps",
        type=float,
        default=2.0,
        help="mode.offload=disk: GB/s one rank reads from its offload file's disk (2)",
    )
    parser.add_argument(
        "--disk-write-gbps",
        type=float,
        default=2.0,
        help="mode.offload=disk: GB/s one rank writes to it (2)",
    )
    parser.add_argument(
        "--host-link-gbps",
        type=float,
        default=25.0,
        help="mode.offload=host: GB/s between device and host, each way (25: PCIe 4.0 x16)",
    )
    parser.add_argument(
        "--host-step-ns",
        type=float,
        default=1.0,
        help="mode.offload=host: ns the host's fused AdamW takes per parameter (1: one core)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s of one device in the compute dtype (H100 SXM: 989 bf16, 67 fp32)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_intermixed_args(argv)
    check_group_choices(args.overrides)
    try:
        cluster = _cluster(args)
        # A bare count has no batch to divide over the ranks.
        cfgs = compose_modes(
            args.overrides, 1 if args.params else args.world_size, args.replica_groups
        )
        result = estimate(cfgs, cluster, args.device_gb * 1e9, args.shard_group_size, args.params)
    except ConfigError as e:
        fail(str(e))
    if args.json:
        print(to_json(result))
    else:
        print(table(result, _header(args, cluster, cfgs, result)))


def _cluster(args: argparse.Namespace) -> Cluster:
    for name in ("world_size", "ranks_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("device_gb", "intra_gbps", "inter_gbps", "peak_tflops", "disk_read_gbps",
                 "disk_write_gbps", "host_link_gbps", "host_step_ns", "across_gbps"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be > 0")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu} must be in (0, 1]")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    return Cluster(
        args.world_size, args.ranks_per_node, args.intra_gbps * 1e9, args.inter_gbps * 1e9,
        peak, args.mfu, args.disk_read_gbps * 1e9, args.disk_write_gbps * 1e9,
        args.host_link_gbps * 1e9, args.host_step_ns * 1e-9, args.across_gbps * 1e9,
    )  # fmt: skip


def _header(args: argparse.Namespace, cluster: Cluster, cfgs: dict, result: dict) -> list[str]:
    cfg = next(iter(cfgs.values()))
    fig = next(f for f in result.values() if "refused" not in f)
    what = f"{fig['params']:,} parameters"
    groups = groups_of(cfg)
    if "micro_batch" in fig:
        ranks = f"{args.world_size} ranks" + (f" x {groups} groups" if groups > 1 else "")
        what = (
            f"{cfg.model._target_.rsplit('.', 1)[-1]}, {what}; micro-batch {fig['micro_batch']}"
            f" (batch {cfg.train.batch_size} / {ranks} / "
            f"{fig['grad_accum_steps']} accumulation steps)"
        )
    dtypes = f"precision {cfg.precision}, reduce {cfg.mode.get('reduce_dtype', 'fp32')}"
    if cfg.mode.get("gather_dtype"):  # int8 AllGathers (docs/quantized.md)
        dtypes += f", gather {cfg.mode.gather_dtype}"
    if cfg.mode.get("offload"):  # docs/offload.md
        dtypes += f"; mode.offload={cfg.mode.offload}"
    nodes = -(-args.world_size // args.ranks_per_node)
    peak = peak_flops(cluster, Precision.of(cfg.precision)) / 1e12
    disk = ""
    if cfg.mode.get("offload") == "disk":
        disk = f"; disk {args.disk_read_gbps:g} GB/s read, {args.disk_write_gbps:g} GB/s write"
    elif cfg.mode.get("offload") == "host":
        disk = f"; host link {args.host_link_gbps:g} GB/s, host step {args.host_step_ns:g} ns/param"
    if groups > 1:  # [Note: traffic across replica groups]
        disk += f"; {groups} replica groups, {args.across_gbps:g} GB/s between them"
    elif cfg.ft.enabled:  # ft keys given, --replica-groups not
        disk += "; 1 replica group: nothing crosses groups (--replica-groups N)"
    return [
        f"model: {what}; {dtypes}",
        f"cluster: {args.world_size} ranks on {nodes} node(s) of {args.ranks_per_node}; "
        f"{args.intra_gbps:g} GB/s in node, {args.inter_gbps:g} GB/s across; "
        f"{peak:g} TFLOP/s peak x MFU {args.mfu:g}{disk}",
    ]


if __name__ == "__main__":
    main()
