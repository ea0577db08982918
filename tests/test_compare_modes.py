"""scripts/compare_modes.py's summary as a user sees it: the TensorBoard events of its
per-mode runs (x = world size), the headline table and the chart, from the figures of
six runs as train.py writes them to final_metrics.json (no training here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tb_events import layout, scalars, text

from trainer.observe.memory import expected

ROOT = Path(__file__).resolve().parents[1]
PSI = 3_192_842  # the script's default MLP (hidden 1024, depth 4)
MiB = 2**20


def _script():
    spec = importlib.util.spec_from_file_location(
        "compare_modes", ROOT / "scripts/compare_modes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _final(mode: str, p: int) -> dict[str, float]:
    """The memory figures of one fp32 AdamW run: measured = formula + 40 bytes of step
    counters, as the real runs give (docs/compare_modes.md)."""
    exp = expected(mode, PSI, p, 4, 4, 8, unit_bytes=16 * MiB if mode == "fsdp" else 0)
    out = {f"memory/expected/{k}_MiB": v / MiB for k, v in exp.items() if v}
    for k in ("params", "grads", "optimizer", "model_state"):
        out[f"memory/{k}_MiB/max"] = (exp[k] + (40 if k != "params" else 0)) / MiB
    out["memory/model_state_MiB/max"] = (exp["model_state"] + 80) / MiB
    out["memory/peak_step_MiB/max"] = out["memory/model_state_MiB/max"] + 20
    out["comm/bytes_per_step/total"] = 2 * (p - 1) / p * PSI * 4
    out["train/loss"] = 1.0
    return out


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    cm = _script()
    results = {p: {m: _final(m, p) for m in ("ddp", "zero", "fsdp")} for p in (2, 4)}
    out = tmp_path_factory.mktemp("compare")
    head = cm.headline(results)
    cm.write_summary(out, results, head)
    return cm, results, out, head


def test_first_chart_has_world_size_on_x_and_modes_as_lines(summary):
    _, _, out, _ = summary
    categories = layout(out / "by_world_size" / "ddp")
    title, charts = categories[0]
    assert title == "modes side by side (x: world size; one line per mode)"
    assert charts[:2] == [
        ("model state per rank, MiB (measured) - x: world size", ["^compare/model_state_MiB$"]),
        (
            "model state as a fraction of ddp's (measured) - x: world size",
            ["^compare/fraction_of_ddp$"],
        ),
    ]
    # then every run's own categories, loss first ([Note: one layout, merged over runs])
    assert [c for c, _ in categories[1:]] == ["training", "memory per rank, MiB", "communication"]
    # every mode's run carries the same layout; one run per mode: one colour per mode
    for mode in ("zero", "fsdp"):
        assert layout(out / "by_world_size" / mode) == categories


def test_summary_scalars_are_mib_per_rank_at_step_world_size(summary):
    _, _, out, _ = summary
    runs = {m: scalars(out / "by_world_size" / m) for m in ("ddp", "zero", "fsdp")}
    state = {m: dict(r["compare/model_state_MiB"]) for m, r in runs.items()}
    assert set(state["zero"]) == {2, 4}  # steps are world sizes
    measured = lambda n: pytest.approx((n + 80) / MiB)  # noqa: E731  (formula + 80 bytes)
    assert state["ddp"][2] == state["ddp"][4] == measured(16 * PSI)  # 48.7 MiB
    assert state["zero"][4] == measured(4 * PSI + 3 * PSI)  # 4Ψ + 12Ψ/4
    assert state["fsdp"][4] == measured(4 * PSI)  # 16Ψ/4
    fraction = dict(runs["zero"]["compare/fraction_of_ddp"])
    assert fraction[2] == pytest.approx(0.625, rel=1e-5)
    assert fraction[4] == pytest.approx(0.4375, rel=1e-5)
    saved = dict(runs["fsdp"]["compare/saved_vs_ddp_MiB"])
    assert saved[4] == pytest.approx(12 * PSI / MiB)
    formula = dict(runs["zero"]["compare/formula_model_state_MiB"])
    assert formula[2] == pytest.approx(10 * PSI / MiB)
    assert (
        "compare/peak_step_MiB" in runs["ddp"]
        and "compare/peak_cuda_allocated_MiB" not in runs["ddp"]
    )


def test_headline_is_short_and_logged_as_text(summary):
    cm, _, out, head = summary
    rows = head.splitlines()
    assert (
        rows[0] == "| mode | P=2: MiB per rank | saved vs ddp | P=4: MiB per rank | saved vs ddp |"
    )
    assert rows[2] == "| `ddp` | 48.7 | (baseline) | 48.7 | (baseline) |"
    assert rows[3] == "| `zero` | 30.4 | 18.3 MiB (37.5 %) | 21.3 | 27.4 MiB (56.2 %) |"
    assert rows[4] == "| `fsdp` | 24.4 | 24.4 MiB (50.0 %) | 12.2 | 36.5 MiB (75.0 %) |"
    assert "within 80 bytes of its formula" in head
    assert max(len(r) for r in rows[:5]) < 90
    assert text(out / "by_world_size" / "ddp", "compare/headline") == head
    assert [cm.sig3(x) for x in (48.72, 0.4375, 1234.5, 0.0)] == ["48.7", "0.438", "1234", "0"]


def test_chart_is_a_small_png(summary, tmp_path):
    cm, results, _, _ = summary
    png = tmp_path / "chart.png"
    assert cm.chart(results, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
