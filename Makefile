PY := .venv/bin/python
NPROC ?= 2

.PHONY: install train test test-kernels lint

# Idempotent: the stamp is rebuilt only when the project's metadata changes.
install: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

train: install
	.venv/bin/torchrun --standalone --nproc-per-node=$(NPROC) train.py mode=zero

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# Another CPU rounds sums otherwise: the tests that compare training against a reference,
# under each of PyTorch's CPU kernel sets that this CPU supports but does not pick itself
# (ATEN_CPU_CAPABILITY, read at process start and inherited by every rank).
KERNEL_TESTS ?= tests/test_ddp.py tests/test_zero.py tests/test_fsdp.py tests/test_hybrid.py \
	tests/test_peer_patterns.py tests/test_control_flow.py tests/test_training_features.py \
	tests/test_precision.py tests/test_fp16_backward.py tests/test_checkpoint.py \
	tests/test_third_party.py tests/test_overlap.py tests/test_launch.py tests/test_own_text.py \
	tests/test_compile.py tests/test_meta_build.py tests/test_materialize.py tests/test_weights.py \
	tests/test_experts.py tests/test_checkpoint_experts.py tests/test_offload.py tests/test_ft.py \
	tests/test_diloco.py tests/test_unit_order.py

# torch takes ATEN_CPU_CAPABILITY at its word: asked for avx512 on a CPU without it, it says
# avx512 and dies of an illegal instruction. So the CPU's own flags decide what runs.
export HAS_FLAGS := import sys; flags = open("/proc/cpuinfo").read().split(); \
	need = {"avx2": ["avx2", "fma"], "avx512": ["avx512f", "avx512bw", "avx512vl", "avx512dq"]}; \
	sys.exit(0 if all(f in flags for f in need.get(sys.argv[1], [])) else 1)

test-kernels: install
	@own=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in default avx2 avx512; do \
	  [ "$$cap" = "$$own" ] && continue; \
	  got=$$(ATEN_CPU_CAPABILITY=$$cap $(PY) -W ignore -c \
	    "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	  if [ "$$got" != "$$cap" ] || ! $(PY) -c "$$HAS_FLAGS" $$cap; then \
	    echo "test-kernels: $$cap: not on this CPU, skipped"; continue; fi; \
	  echo "test-kernels: ATEN_CPU_CAPABILITY=$$cap (this CPU picks $$own)"; \
	  ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -n 2 --dist loadfile $(KERNEL_TESTS) || exit 1; \
	done

lint: install
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
