"""Textbook outcomes of every collective on 4 ranks (the table in docs/collectives.md).

The demo functions of scripts/collectives_demo.py run on 4 real Gloo processes once per
module and each test checks one primitive's before/after. One test runs the demo script
under torchrun and reads its printed line; one runs the benchmark at 2 ranks.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import warm_cli
from dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts" / "collectives_demo.py"
BENCH = ROOT / "scripts" / "benchmarks" / "comm_bench.py"
P = 4


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_demos(env) -> dict:
    from trainer import comm
    from trainer.comm.all_to_all import all_to_all_uneven

    demo = _load(DEMO)
    out = {
        name: getattr(demo, f"demo_{name}")(env)
        for name in (
            "broadcast", "reduce", "all_reduce", "gather", "scatter", "all_to_all",
            "all_to_all_uneven",
        )
    }  # fmt: skip
    for path in ("native", "p2p"):  # comm's two implementations must agree
        with comm.p2p(path == "p2p"):
            out["all_gather", path] = demo.demo_all_gather(env)
            out["reduce_scatter", path, 1] = demo.demo_reduce_scatter(env, example=1)
            out["reduce_scatter", path, 2] = demo.demo_reduce_scatter(env, example=2)

    # all_to_all_uneven with rows of 2 columns, and a rank (the last) that receives nothing.
    r = env.rank
    pieces = [torch.full((r + 1 if j < P - 1 else 0, 2), 10.0 * r + j) for j in range(P)]
    received, handle = all_to_all_uneven(pieces)
    handle.wait()
    out["uneven_rows"] = [t.tolist() for t in received]
    try:
        all_to_all_uneven(pieces[:2])
    except ValueError as e:
        out["uneven_error"] = str(e)

    out["barrier"] = demo.demo_barrier(env, late_s=0.5)
    return out


@pytest.fixture(scope="module")
def demos() -> list[dict]:
    return run_distributed(_run_demos, P)


def _column(demos, key, which):  # which: 0 = before, 1 = after; one entry per rank
    return [d[key][which] for d in demos]


def test_broadcast(demos):
    assert _column(demos, "broadcast", 0) == [["A"], "empty", "empty", "empty"]
    assert _column(demos, "broadcast", 1) == [["A"]] * P


def test_reduce_sums_onto_rank0(demos):
    assert _column(demos, "reduce", 0) == [[1], [2], [3], [4]]
    assert _column(demos, "reduce", 1) == [[10], "undefined", "undefined", "undefined"]


def test_all_reduce(demos):
    assert _column(demos, "all_reduce", 0) == [[1, 10], [2, 20], [3, 30], [4, 40]]
    assert _column(demos, "all_reduce", 1) == [[10, 100]] * P


def test_gather_to_rank0(demos):
    assert _column(demos, "gather", 0) == [["A"], ["B"], ["C"], ["D"]]
    assert _column(demos, "gather", 1) == [["A", "B", "C", "D"]] + ["nothing"] * 3


@pytest.mark.parametrize("path", ["native", "p2p"])
def test_all_gather(demos, path):
    assert _column(demos, ("all_gather", path), 0) == [["A"], ["B"], ["C"], ["D"]]
    assert _column(demos, ("all_gather", path), 1) == [["A", "B", "C", "D"]] * P


def test_scatter_from_rank0(demos):
    assert _column(demos, "scatter", 0) == [["A", "B", "C", "D"]] + ["empty"] * 3
    assert _column(demos, "scatter", 1) == [["A"], ["B"], ["C"], ["D"]]


@pytest.mark.parametrize("path", ["native", "p2p"])
def test_reduce_scatter_first_example(demos, path):
    key = ("reduce_scatter", path, 1)
    assert _column(demos, key, 0) == [
        [0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    ]  # fmt: skip
    assert _column(demos, key, 1) == [[60], [64], [68], [72]]


@pytest.mark.parametrize("path", ["native", "p2p"])
def test_reduce_scatter_second_example(demos, path):
    key = ("reduce_scatter", path, 2)
    assert _column(demos, key, 0) == [
        [1, 2, 3, 4], [10, 20, 30, 40], [100, 200, 300, 400], [1000, 2000, 3000, 4000]
    ]  # fmt: skip
    assert _column(demos, key, 1) == [[1111], [2222], [3333], [4444]]


def test_all_to_all(demos):
    assert demos[2]["all_to_all"] == ([20, 21, 22, 23], [2, 12, 22, 32])
    assert _column(demos, "all_to_all", 1) == [
        [0, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32], [3, 13, 23, 33]
    ]  # fmt: skip


def test_all_to_all_uneven(demos):
    # rank r sends (3r + j) % 4 copies of 10r + j to rank j
    assert demos[2]["all_to_all_uneven"] == (
        [[20, 20], [21, 21, 21], [], [23]],
        [[2, 2], [12], [], [32, 32, 32]],
    )
    assert _column(demos, "all_to_all_uneven", 1) == [
        [[], [10, 10, 10], [20, 20], [30]],
        [[1], [], [21, 21, 21], [31, 31]],
        [[2, 2], [12], [], [32, 32, 32]],
        [[3, 3, 3], [13, 13], [23], []],
    ]


def test_all_to_all_uneven_rows_and_empty_receiver(demos):
    for r, d in enumerate(demos):
        want = [[[10.0 * i + r] * 2] * (i + 1) if r < P - 1 else [] for i in range(P)]
        assert d["uneven_rows"] == want
        assert d["uneven_error"] == "all_to_all_uneven: got 2 pieces for world size 4"


def test_barrier_holds_back_early_ranks(demos):
    arrived, left = zip(*(d["barrier"] for d in demos), strict=True)  # seconds since a shared start
    assert arrived[0] >= 0.5  # rank 0 slept before the barrier
    for r in range(1, P):
        assert arrived[r] < arrived[0]  # the others came early ...
        assert left[r] >= arrived[0]  # ... and were held until rank 0 arrived


def _torchrun(nproc: int, script: Path, *args: str, timeout: float = 180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(script), *args]
    done = warm_cli.command(cmd, {"OMP_NUM_THREADS": "1"}, timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_demo_script_under_torchrun():
    out = _torchrun(4, DEMO, "all_to_all")
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert lines == [
        "rank 0: all_to_all input=[0, 1, 2, 3] -> [0, 10, 20, 30]",
        "rank 1: all_to_all input=[10, 11, 12, 13] -> [1, 11, 21, 31]",
        "rank 2: all_to_all input=[20, 21, 22, 23] -> [2, 12, 22, 32]",
        "rank 3: all_to_all input=[30, 31, 32, 33] -> [3, 13, 23, 33]",
    ]


def test_comm_bench_json(tmp_path):
    bench = _load(BENCH)
    out_json = tmp_path / "bench.json"
    args = ["--max-mb", "0.004", "--iters", "2", "--warmup", "1", "--out", str(out_json)]
    stdout = _torchrun(2, BENCH, *args)
    assert "| op | impl | size | time (ms) | algbw (GB/s) | busbw (GB/s) |" in stdout
    result = json.loads(out_json.read_text())
    assert result["backend"] == "gloo" and result["world_size"] == 2
    rows = result["rows"]
    expected = {
        (op, impl, size)
        for op in bench.OPS
        for impl in (("native", "p2p") if op in bench.HAS_P2P else ("native",))
        for size in (1024, 4096)
    }
    assert {(row["op"], row["impl"], row["bytes"]) for row in rows} == expected
    assert len(rows) == len(expected)
    for row in rows:
        assert row["time_ms"] > 0 and row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0
        factor = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0}.get(row["op"], 0.5)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        assert row["ring_traffic_bytes"] == pytest.approx(row["bytes"] * factor)
