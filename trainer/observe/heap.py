"""Peak memory of one step on CPU, where torch keeps no allocator statistics.

[Note: the CPU step peak]
A CPU tensor's storage comes from malloc, so the C heap in use follows the live tensors:
glibc's `mallinfo2()` (in-use chunks of every arena plus the blocks malloc mapped on its
own, so buffers of the backend's threads count too), sampled after every tensor op of a
step by a TorchDispatchMode (forward, backward, hooks, collectives, optimizer). The
step's peak above the heap at its start is what the step allocated for a moment:
activations, gathered fsdp units, bucket and receive buffers, gradients, optimizer
temporaries. The process's resident set is of no use here: about 1 GB of it is torch's
own libraries, the same in every mode. `scripts/benchmarks/bench.py` measures its peaks this way.

`keep_freed_pages()` is the one setting of the C heap a run makes ([Note: keeping freed
pages]).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class _Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


try:
    _libc = ctypes.CDLL(None)
except OSError:  # no C library to open by that name (not Linux)
    _libc = None
_mallinfo2 = getattr(_libc, "mallinfo2", None)  # glibc >= 2.33
_mallopt = getattr(_libc, "mallopt", None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
if _mallopt is not None:
    _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
if _mallinfo2 is not None:
    _mallinfo2.restype = _Mallinfo2


def available() -> bool:
    return _mallinfo2 is not None


# [Note: keeping freed pages]
# glibc returns freed memory to the kernel when more than M_TRIM_THRESHOLD lies free at the
# top of a heap, and serves blocks above M_MMAP_THRESHOLD with mmap of their own, unmapped
# at free. Both start small (128 KiB) and rise only as far as the largest block freed so far
# (x2 for trimming). A training step frees its activations and gradients together, more
# than that, and the next step faults every page back in: about 1,000 faults per step of
# nanoGPT's CPU recipe (1.5-2 ms of a 40 ms step, see docs/bench.md). Set where glibc's own
# rule ends up for large blocks (a 32 MiB mmap threshold, trimming above twice that), a
# step reuses the pages of the step before: no steady faults, and at most 64 MiB of free
# heap kept per malloc arena. Setting any of these turns glibc's rule off, so a user's
# MALLOC_*_ or GLIBC_TUNABLES choice is left as it is.
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES",
)  # fmt: skip


def keep_freed_pages() -> bool:
    """Have glibc keep a step's freed blocks for the next step ([Note: keeping freed
    pages]). Returns whether it was set: not without glibc, nor where the environment
    already tunes malloc."""
    if _mallopt is None or any(k in os.environ for k in _USER_SETTINGS):
        return False
    return bool(
        _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_free_pages() -> None:
    """Give the heap's free pages back to the kernel now (glibc's malloc_trim, which also
    releases free chunks inside the heap, not only at its top); nothing without glibc.
    What an offloaded step frees is not needed again before the next step reads it back
    ([Note: offloaded state] in trainer/offload/state.py)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def heap_bytes() -> int:
    """Bytes in use in the C heap of this process, every thread and arena included.
    Raises RuntimeError where glibc's mallinfo2() is missing (see `available()`)."""
    if _mallinfo2 is None:
        raise RuntimeError("the C heap size needs glibc's mallinfo2() (glibc >= 2.33)")
    m = _mallinfo2()
    return m.uordblks + m.hblkhd  # in-use heap chunks + blocks malloc mapped on its own


class HeapPeak(TorchDispatchMode):
    """Samples `heap_bytes()` after every tensor op run under it; `peak` is the highest,
    `start` the heap when it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.start = self.peak = heap_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_bytes())
        return out

    @property
    def growth(self) -> int:
        """Bytes above the heap at the start, at the highest point so far."""
        return max(0, self.peak - self.start)


class StepPeak:
    """The CPU peak of a training step: what lived at its start plus the heap's growth
    during it ([Note: the CPU step peak]).

    Sampling starts at the module's first training forward after `arm()` (a forward
    pre-hook that runs before any other, so before fsdp gathers its root unit) and ends
    after the optimizer step (its post-hook), so it covers forward, backward, the
    collectives and the optimizer. `held()` gives the bytes of model state and
    communication buffers alive at the start, counted from their storages. One step per
    arming: the dispatch mode slows every op it sees, so the other steps run without it.
    A subclass measures the same window another way (`_begin`, `_now`, `_end`): the
    CUDA allocator's peak, `memory.CudaStepPeak`.
    """

    def __init__(self, module, optimizer, held: Callable[[], int] | None = None):
        self._held = held
        self._mode: HeapPeak | None = None
        self._base = 0  # bytes held when the sampled step started
        self._armed = True
        self._sampling = False
        self._peak: int | None = None  # highest figure since the last take()
        module.register_forward_pre_hook(self._start, prepend=True)
        optimizer.register_step_post_hook(self._stop)

    def arm(self) -> None:
        self._armed = True

    def _begin(self) -> None:
        self._base = self._held()
        self._mode = HeapPeak()
        self._mode.__enter__()

    def _now(self) -> int:
        """The sampled step's peak so far."""
        return self._base + self._mode.growth

    def _end(self) -> None:
        self._mode.__exit__(None, None, None)
        self._mode = None

    def _start(self, module, args) -> None:
        if not (self._armed and module.training) or self._sampling:
            return  # eval, steps between samples, or later micro-batches of the sampled step
        self._armed = False
        self._sampling = True
        self._begin()

    def _stop(self, *_: object) -> None:
        if not self._sampling:
            return
        self._record()
        self._end()
        self._sampling = False

    def _record(self) -> None:
        now = self._now()
        self._peak = now if self._peak is None else max(self._peak, now)

    def take(self, arm: bool = True) -> int | None:
        """Highest step peak since the last call (None: no step sampled); `arm`: sample
        the next step. A step still being sampled (its optimizer step skipped) counts so
        far."""
        if self._sampling:
            self._record()
        peak, self._peak = self._peak, None
        if arm:
            self.arm()
        return peak
