#!/usr/bin/env bash
# Run each mode for a few steps on the GPUs with NCCL (one rank per GPU) and compare the
# final parameters with a CPU Gloo run of the same steps on as many ranks; the GPU run
# also writes a profiler trace. One line per check, then a verdict; the exit status is 0
# only if every check ran and matched. On one GPU it is one rank against one: the verdict
# says that no collective between ranks was exercised.
#
#   scripts/gpu_check.sh [--cpu] [steps] [extra Hydra overrides for both runs...]
#   scripts/gpu_check.sh 20 precision=bf16         # bf16 gets a looser tolerance, below
#   scripts/gpu_check.sh --cpu 4 model.hidden=32   # no GPU: Gloo (2 ranks) against Gloo
#   CPU_RANKS=1 scripts/gpu_check.sh --cpu 4       # the one-rank path, as on one GPU
#
# --cpu runs the same logic with Gloo on both sides, so the script itself is tested
# where no GPU is (tests/test_gpu_check.py). Environment:
#   OUT_DIR  where runs and logs go (default runs/gpu_check; emptied first)
#   TOL      max |dparam| allowed, relative to the largest |param| (default 1e-3;
#            2e-2 with precision=bf16|fp16: their kernels round differently on GPU and
#            CPU, and cuBLAS reduces bf16 products in reduced precision by default)
#   MODES    rows to check: a mode, or mode+host for that mode with mode.offload=host in
#            the run under test (its reference runs without: the state in host memory,
#            stepped there, against the plain CPU run). Default "ddp zero fsdp zero+host
#            fsdp+host" on GPUs, "ddp zero fsdp" with --cpu (offload=host is a GPU path)
#   CPU_RANKS  ranks of a --cpu run (default 2)
#   CHECKED_OVERRIDES  Hydra overrides for the run under test only (tests use them to
#            make it differ from or fail against the reference)
#   PY       the Python to use (default .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."

cpu=0
if [ "${1:-}" = "--cpu" ]; then
  cpu=1
  shift
fi
steps=${1:-20}
shift || true
case "$steps" in
  '' | *[!0-9]* | 0*) echo "gpu_check: steps must be a positive integer, got '$steps'" >&2; exit 2 ;;
esac
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if [ "$cpu" = 1 ]; then
  nproc=${CPU_RANKS:-2}
  case "$nproc" in
    '' | *[!0-9]* | 0*) echo "gpu_check: CPU_RANKS must be a positive integer, got '$nproc'" >&2; exit 2 ;;
  esac
  checked=(dist.backend=gloo)
  checked_env=(CUDA_VISIBLE_DEVICES=)
  what="Gloo vs CPU Gloo (--cpu)"
  single="1 rank: single rank, no Gloo collective between ranks was exercised"
else
  nproc=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "$nproc" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU visible (scripts/gpu_check.sh --cpu checks the script on CPU)" >&2
    exit 1
  fi
  checked=(dist.backend=nccl)
  checked_env=()
  what="NCCL vs CPU Gloo"
  single="1 GPU: single rank, no NCCL collective between ranks was exercised"
fi
# One rank compares the modes' arithmetic on the device only: nothing is sent, and the
# verdict says so.
verdict="$what"
[ "$nproc" = 1 ] && verdict="$what; $single"

tol=${TOL:-1e-3}
if [ -z "${TOL:-}" ]; then
  for arg in "$@"; do
    case "$arg" in precision=bf16 | precision=fp16) tol=2e-2 ;; esac
  done
fi

out=${OUT_DIR:-runs/gpu_check}
rm -rf "$out"
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 1; }

# The global batch is a multiple of the rank count (any GPU count works); later
# overrides of the same key, the caller's included, take precedence.
common=(train.steps="$steps" train.log_every=5 train.eval_every=0 train.save_final=true
  train.batch_size=$((32 * nproc)) "$@")
read -r -a extra <<<"${CHECKED_OVERRIDES:-}"

rows=${MODES:-ddp zero fsdp zero+host fsdp+host}
[ "$cpu" = 1 ] && rows=${MODES:-ddp zero fsdp}
failed=()
for row in $rows; do
  mode=${row%%+*}
  offload=()
  [ "$row" != "$mode" ] && offload=(mode.offload="${row#*+}")
  log_checked="$out/$row-checked.log" log_ref="$out/$row-reference.log"
  if ! env "${checked_env[@]}" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node="$nproc" train.py mode="$mode" "${checked[@]}" profile=true \
    "${common[@]}" "${offload[@]}" "${extra[@]}" hydra.run.dir="$out/$row-checked" >"$log_checked" 2>&1; then
    echo "$row: FAILED run under test, see $log_checked"
    failed+=("$row")
    continue
  fi
  if ! CUDA_VISIBLE_DEVICES= "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node="$nproc" train.py mode="$mode" dist.backend=gloo \
    "${common[@]}" hydra.run.dir="$out/$row-reference" >"$log_ref" 2>&1; then
    echo "$row: FAILED CPU Gloo reference run, see $log_ref"
    failed+=("$row")
    continue
  fi
  if ! "$PY" - "$row" "$out" "$nproc" "$tol" "$what" <<'PYEOF'; then
import json, sys
from pathlib import Path
import torch
mode, out, nproc, tol, what = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
def final(run):  # the final model: final_model.pt, or model=hf's final_model/
    if (run / "final_model.pt").is_file():
        return torch.load(run / "final_model.pt", weights_only=True)
    from trainer.models.lm import hf_causal_lm
    return hf_causal_lm(str(run / "final_model")).state_dict()
run, ref = final(out / f"{mode}-checked"), final(out / f"{mode}-reference")
if run.keys() != ref.keys():
    print(f"{mode}: MISMATCH parameter names differ")
    sys.exit(1)
diff = max((run[k].float() - ref[k].float()).abs().max().item() for k in ref)
scale = max(ref[k].float().abs().max().item() for k in ref)
ok = diff <= tol * max(scale, 1.0)
m = json.loads((out / f"{mode}-checked" / "final_metrics.json").read_text())
traces = sorted((out / f"{mode}-checked" / "traces").glob("rank*.json"))
print(f"{mode}: {'OK' if ok else 'MISMATCH'} {nproc} rank(s) {what}, max |dparam| {diff:.2e} "
      f"(tol {tol:g} x {max(scale, 1.0):.2f}), loss {m.get('train/loss', float('nan')):.4f}, "
      f"overlap {m.get('comm/overlap_pct', float('nan')):.0f}%, "
      f"{m.get('perf/samples_per_s', 0):.0f} samples/s, trace {traces[0] if traces else 'none'}")
sys.exit(0 if ok else 1)
PYEOF
    failed+=("$row")
  fi
done

if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_check: PASS ($rows; $verdict)"
else
  echo "gpu_check: FAIL (${failed[*]})"
  exit 1
fi
