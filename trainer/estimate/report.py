"""The estimate as a short table for people, or as JSON for programs."""

from __future__ import annotations

import json
from typing import Any

UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))  # decimal, as devices are sold


def to_json(result: dict[str, dict[str, Any]]) -> str:
    return json.dumps(result, indent=2)


def table(result: dict[str, dict[str, Any]], header: list[str]) -> str:
    """One row per mode (and one per mode with activation checkpointing switched, when
    the model has the option): memory per rank, bytes sent per rank and step, seconds.
    A mode that refuses the configuration gets a line saying why."""
    refused = {m: f["refused"] for m, f in result.items() if "refused" in f}
    result = {m: f for m, f in result.items() if m not in refused}
    figs = list(result.values())
    full = "activation_bytes" in figs[0]
    mem_name, mem = _unit(max(_largest(f) for f in figs))
    sent = [_sent(f) for f in figs]
    net_name, net = _unit(max(max(s) for s in sent))
    cols = ["mode", "params", "master", "grads", "optim", "state", "build", "meta build"]
    if full:
        cols += ["working", "activ.", "total"]
    cols += [f"fits {figs[0]['device_bytes'] / 1e9:g} GB"]
    if full:
        cols += ["max micro"]
    cols += ["sent in node", "across nodes"]
    if full:
        cols += ["step s"]
    rows = [cols]
    for (mode, f), (inside, across) in zip(result.items(), sent, strict=True):
        state = [f["model_state_by_kind"][k] for k in ("params", "master", "grads", "optimizer")]
        state.append(f["model_state_bytes_per_rank"])
        # to the first step ([Note: the build peak] in layout.py)
        state += [f["build_peak_bytes"]["ordinary"], f["build_peak_bytes"]["meta"]]
        variants = [(_name(mode, f), f)]
        if "alternative" in f:
            on = f["alternative"]["activation_checkpointing"]
            variants.append((f"{mode} {'+' if on else '-'}ckpt", f["alternative"]))
        for name, v in variants:
            row = [name] + ["-" if n is None else f"{n / mem:.2f}" for n in state]
            if full:
                row += [f"{n / mem:.2f}" for n in (f["working_set_bytes"], v["activation_bytes"])]
                row.append(f"{v['total_bytes'] / mem:.2f}")
            row.append("yes" if v["fits"] else "no")
            if full:
                row.append("-" if v["max_micro_batch"] is None else str(v["max_micro_batch"]))
            row += [f"{inside / net:.2f}", f"{across / net:.2f}"]
            if full:
                row.append(f"{v['step_s']:.3g}")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [*header, f"memory per rank in {mem_name}, bytes sent per rank and step in {net_name}"]
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    for mode, f in result.items():  # expert parallelism ([Note: expert parameters in every mode])
        x = f.get("experts")
        if x:
            lines.append(
                f"{mode}: experts {x['expert_params']:,} parameters, per rank "
                f"{x['expert_params_held_per_rank']:,} held and "
                f"{x['expert_params_stepped_per_rank']:,} stepped at mode.expert_parallel="
                f"{x['expert_parallel']}; AllToAll {x['all_to_all_bytes_per_step'] / net:.2f} "
                f"{net_name} sent per rank and step (not in the sent columns"
                f"{'; in step s' if full else ''})"
            )
    for mode, f in result.items():  # mode.offload=disk ([Note: offloaded state]), host
        o = f.get("offload")
        if o and "host_bytes" in o:  # [Note: host offload]
            name, size = _unit(o["host_bytes"])
            lines.append(
                f"{mode}: offload=host keeps the fp32 masters and the optimizer state in "
                f"{o['host_bytes'] / size:.2f} {name} of host memory per rank "
                f"({o['arena_bytes'] / size:.2f} {name} of it pinned; not in the memory "
                f"columns); each step copies {o['bus_bytes_per_step'] / size:.2f} {name} "
                f"across the bus and steps on the host: {o['io_s']:.3g} s"
                f"{', in step s' if full else ''}"
            )
        elif o:
            name, size = _unit(max(o["file_bytes"], o["io_bytes_per_step"]))
            moved = (
                "the optimizer state and the fp32 masters"
                if o["moves_master"]
                else ("the optimizer state")
            )
            lines.append(
                f"{mode}: offload=disk keeps {moved} in a {o['file_bytes'] / size:.2f} {name} "
                f"file per rank (not in the memory columns; a step holds up to "
                f"{o['stepping_bytes'] / size:.2f} {name} of it, in working); each step reads "
                f"and writes {o['io_bytes_per_step'] / size:.2f} {name}: {o['io_s']:.3g} s"
                f"{', in step s' if full else ''}"
            )
    for mode, f in result.items():  # [Note: traffic across replica groups]
        if "replica_groups" in f:
            lines.append(_across(mode, f["replica_groups"], full))
    for mode, why in refused.items():
        lines.append(f"{mode}: refused: {why}")
    if any("alternative" in f for f in figs):
        lines.append("+ckpt / -ckpt: the same with model.activation_checkpointing switched")
    if all("checkpoint_save_bytes" in f for f in figs):
        saves = [(mode, f["checkpoint_save_bytes"]) for mode, f in result.items()]
        name, size = _unit(max(s["async"] for _, s in saves))
        each = ", ".join(f"{m} {s['async'] / size:.2f}" for m, s in saves)
        lines.append(
            f"checkpoint save, extra host memory per rank in {name}: "
            f"sync {saves[0][1]['sync'] / size:.2f} (ckpt.buffer_mb); async, with a host copy "
            f"of the rank's data file: {each}"
        )
    return "\n".join(lines)


def _largest(f: dict[str, Any]) -> float:
    """The largest memory figure of a mode, which sets the table's unit."""
    build = [v for v in f["build_peak_bytes"].values() if v is not None]
    return max(f.get("total_bytes", f["model_state_bytes_per_rank"]), *build)


def _sent(f: dict[str, Any]) -> tuple[float, float]:
    traffic = f["traffic_bytes_per_step"].values()
    return sum(t["inside_node"] for t in traffic), sum(t["across_nodes"] for t in traffic)


def _unit(largest: float) -> tuple[str, float]:
    return next((name, size) for name, size in UNITS if largest >= size or size == 1)


def _name(mode: str, f: dict[str, Any]) -> str:
    s = f.get("shard_group_size")
    return f"{mode} S={s}" if s is not None and s < f["world_size"] else mode


def _across(mode: str, a: dict[str, Any], full: bool) -> str:
    """One line on the traffic between replica groups and the time a step waits on it."""
    per_step = _bytes(a["bytes_per_step"])
    link = f"{a['link_s_per_sync']:.3g} s on the {a['link_Bps'] / 1e9:g} GB/s link"
    wait = a["exposed_s_per_step"]
    shown = "" if wait is None else f"{wait:.3g} s per step{', in step s' if full else ''}"
    if a["sync"] == "every_step":
        return (
            f"{mode}: across {a['replica_groups']} replica groups every step, an fp32 "
            f"AllReduce of each rank's gradients: {per_step} per rank and step, {link}, "
            f"waited for: {shown}"
        )
    tau = a["fragment_sync_delay"]
    if tau == 0:
        hidden = f"waited for at once: {shown}"
    elif wait is None:  # no step time to hide it behind (a bare count, no pass)
        hidden = f"hidden behind {tau} step(s) as far as a step's time allows"
    else:
        hidden = f"beyond what {tau} step(s) hide: {shown}"
    f, every = a["fragments"], a["sync_every_steps"]
    what = "the model" if f == 1 else f"one of {f} fragments"
    when = "every step" if every == 1 else f"every {every} steps"
    return (
        f"{mode}: {a['sync']} across {a['replica_groups']} replica groups, {what} {when}, "
        f"{a['wire']} on the wire: {per_step} per rank and "
        f"step over a sync period, at most {_bytes(a['peak_bytes_per_sync'])} a sync "
        f"({link}); {hidden}"
    )


def _bytes(n: float) -> str:
    name, size = _unit(n)
    return f"{n / size:.2f} {name}"
