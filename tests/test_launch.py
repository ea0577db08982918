"""Launching the way users do: two simulated nodes, and a sweep over modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import warm_cli
from dist_harness import free_port
from test_cli import ROOT, TORCHRUN, run_cli

# optim.eps=1e-3: ddp and fsdp sum in other orders; AdamW's default eps would amplify that
COMMON = ["mode=ddp", "train.steps=8", "train.log_every=4", "model.hidden=32", "optim.eps=1e-3"]


def _final_model(root) -> dict:
    [path] = list(root.glob("*/final_model.pt"))
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_two_nodes_match_one_node_of_four(tmp_path):
    """Two torchrun launchers, --nnodes=2 with c10d rendezvous on localhost, 2 ranks each,
    running fsdp with hybrid sharding over the two nodes (mode.shard_group_size=2), end
    with the same parameters as ddp on one launcher with 4 ranks; and no AllGather or
    ReduceScatter ever ran between ranks of different launchers."""
    port = free_port()
    trace = tmp_path / "trace"
    trace.mkdir()
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes",
        str(ROOT / "tests" / "traced_train.py"),
        *COMMON,
        "mode=fsdp",
        "mode.shard_group_size=2",
        f"run.root={tmp_path / 'two'}",
    ]
    launchers = [
        subprocess.Popen(
            node,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TRACE_DIR": str(trace), "PYTHONPATH": str(ROOT)},
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outs[0][-2000:] + outs[1][-2000:]

    one = warm_cli.command(
        [*TORCHRUN, "--nproc-per-node=4", str(ROOT / "train.py"), *COMMON,
         f"run.root={tmp_path / 'one'}"],
        timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    two, four = _final_model(tmp_path / "two"), _final_model(tmp_path / "one")
    assert two.keys() == four.keys()
    for k in four:
        torch.testing.assert_close(two[k], four[k], atol=1e-6, rtol=1e-5)
    [run_dir] = list((tmp_path / "two").iterdir())  # one directory for both nodes
    assert json.loads((run_dir / "final_metrics.json").read_text())["world_size"] == 4

    records = [json.loads((trace / f"rank{r}.json").read_text()) for r in range(4)]
    launcher = {r: rec["launcher"] for r, rec in enumerate(records)}
    assert sorted(launcher.values()) == [0, 0, 1, 1]
    sharding = [
        ranks
        for rec in records
        for op, ranks in rec["members"]
        if op in ("all_gather", "reduce_scatter")
    ]
    assert len(sharding) > 8 * 2 * 4  # every step's gathers and scatters, on every rank
    for ranks in sharding:
        assert len(ranks) == 2 and len({launcher[r] for r in ranks}) == 1, ranks
    # the gradients' slices did cross, in AllReduces between the launchers
    across = [ranks for rec in records for op, ranks in rec["members"] if op == "all_reduce"]
    assert any({launcher[r] for r in ranks} == {0, 1} and len(ranks) == 2 for ranks in across)


@pytest.mark.slow
def test_sweep_runs_each_mode_as_its_own_job(tmp_path):
    modes = ["ddp", "zero", "fsdp"]
    proc = run_cli(
        [
            "-m",
            f"mode={','.join(modes)}",
            "launcher.nproc=2",
            "train.steps=6",
            "train.log_every=3",
            f"run.root={tmp_path}",
        ],
        nproc=None,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [sweep] = list(tmp_path.iterdir())
    finals = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/final_metrics.json"))]
    assert sorted(f["mode"] for f in finals) == sorted(modes)
    assert all(f["world_size"] == 2 for f in finals)
    assert sorted(
        p.parent.name.rsplit("_", 1)[0] for p in sweep.glob("*/final_metrics.json")
    ) == sorted(f"{m}_p2" for m in modes)
