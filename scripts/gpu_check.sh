#!/usr/bin/env bash
# On a machine with CUDA GPUs: run each mode for a few steps with NCCL (one rank per GPU),
# check the final parameters against a CPU Gloo run of the same steps, and write a
# profiler trace of the GPU run. Prints one line per mode.
#
#   scripts/gpu_check.sh [steps] [extra Hydra overrides...]
#   TOL=2e-2 scripts/gpu_check.sh 20 precision=bf16   # bf16 kernels round differently
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
steps=${1:-20}
shift || true
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU visible" >&2
  exit 1
fi
out=${OUT_DIR:-runs/gpu_check}
rm -rf "$out"
common=(train.steps="$steps" train.log_every=5 train.save_final=true model.hidden=512 "$@")
for mode in ddp zero fsdp; do
  "$PY" -m torch.distributed.run --standalone --nproc-per-node="$ngpu" train.py mode=$mode \
    dist.backend=nccl profile=true "${common[@]}" hydra.run.dir="$out/$mode-nccl" \
    >"$out-$mode-nccl.log" 2>&1 || { echo "$mode: NCCL run failed, see $out-$mode-nccl.log"; continue; }
  CUDA_VISIBLE_DEVICES= "$PY" -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
    train.py mode=$mode dist.backend=gloo "${common[@]}" hydra.run.dir="$out/$mode-gloo" \
    >"$out-$mode-gloo.log" 2>&1 || { echo "$mode: Gloo run failed, see $out-$mode-gloo.log"; continue; }
  "$PY" - "$mode" "$out" "$ngpu" "${TOL:-1e-3}" <<'PYEOF'
import json, sys
from pathlib import Path
import torch
mode, out, ngpu, tol = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
gpu = torch.load(out / f"{mode}-nccl" / "final_model.pt", weights_only=True)
cpu = torch.load(out / f"{mode}-gloo" / "final_model.pt", weights_only=True)
diff = max((gpu[k].float() - cpu[k].float()).abs().max().item() for k in cpu)
scale = max(cpu[k].float().abs().max().item() for k in cpu)
ok = diff <= tol * max(scale, 1.0)
m = json.loads((out / f"{mode}-nccl" / "final_metrics.json").read_text())
traces = sorted((out / f"{mode}-nccl" / "traces").glob("rank*.json"))
print(f"{mode}: {'OK ' if ok else 'MISMATCH'} {ngpu} GPU(s) NCCL vs CPU Gloo, max |dparam| "
      f"{diff:.2e}, loss {m.get('train/loss', float('nan')):.4f}, "
      f"overlap {m.get('comm/overlap_pct', float('nan')):.0f}%, "
      f"{m.get('perf/samples_per_s', 0):.0f} samples/s, trace {traces[0] if traces else 'none'}")
PYEOF
done
