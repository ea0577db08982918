"""GPU checks: skipped where CUDA is absent (the CPU suite covers the same code on Gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_cli import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("precision, tol", [("fp32", "1e-3"), ("bf16", "2e-2")])
def test_every_mode_matches_cpu_gloo_on_gpu(tmp_path, precision, tol):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "6", f"precision={precision}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OUT_DIR": str(tmp_path / "gpu"), "TOL": tol, "PY": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line[:5] in ("ddp: ", "zero:", "fsdp:")]
    assert len(lines) == 3 and all(" OK " in line for line in lines), proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("gpu_check: PASS"), proc.stdout
