"""Collectives that send int8 blocks instead of floats (ZeRO++'s qwZ and qgZ): a quarter of
fp32's bytes, one fp32 scale per `block` values included ([Note: int8 blocks]).

    comm.all_gather_int8(full, shard, block=256, group=g).wait()      # qwZ
    comm.reduce_scatter_int8(out, flat, average=True, group=g).wait()  # qgZ
    comm.all_reduce_int8(flat, average=True).wait()                    # qgZ + qwZ

Each packs its values on the compute stream and hands the bytes to collectives.py's
`all_gather` or all_to_all.py's `all_to_all` (byte counting of what is handed over,
scales included; test hooks; Gloo fast path; comm stream); the returned Handle
dequantizes (and sums) once that collective is waited for. The AllReduce's second
collective is chained on its first, launched once that one has arrived ([Note: int8
AllReduce in two chained phases]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.comm.all_to_all import all_to_all
from trainer.comm.collectives import (
    Handle,
    all_gather,
    all_reduce,
    chain,
    free_storage,
    reduce_scatter,
    world_size,
)
from trainer.comm.groups import gather_group

QMAX = 127  # int8 values in [-127, 127]: symmetric, so -x quantizes to -q(x)

# [Note: int8 blocks]
# A flat tensor is cut into blocks of `block` values (the last one zero-padded); each block
# keeps its largest magnitude m in fp32 (the "scale" that travels) and q = round(127 x / m)
# in int8; a value comes back as q * m / 127, so |x - q m / 127| <= m / 254, half a step,
# for every value (plus fp32 rounding of the ratio and of the product, a few ulps).
# Why m and not m / 127, and x / m and not x * (1 / m): below m ~ 1.5e-36 the step m / 127
# is a subnormal with few significant bits (none below m ~ 1e-43), and below m ~ 3.7e-37
# 1 / step overflows to inf, so such a block came back as +-127 steps. m itself is a value
# of the block, exact in fp32 whatever its size; x / m lies in [-1, 1], correctly rounded
# even when both are subnormal, so q needs no clamp. Dequantizing a block whose step
# would be subnormal ("tiny": m < 2^-96) multiplies by m * 2^32 / 127 (normal) and then
# by 2^-32 (exact but for one rounding into the subnormal range), so a subnormal block
# keeps its half-step bound.
# An all-zero block has m = 0: 0 / 0 is NaN, set to q = 0, and it comes back exactly 0. A
# block holding an inf or a NaN gets m inf or NaN and q 0 (x / inf is 0, inf / inf and NaN
# are set to 0), so every value of it dequantizes to NaN (0 * inf): fp16's overflow check
# downstream still sees it and the step is skipped on every rank.
# What travels is one uint8 row per destination: [q (n_blocks * block)] [scales (4 *
# n_blocks bytes)] [exact tail (4 * tail bytes)]; the tail carries control values that
# must arrive exactly (the used-flags, [Note: used flags] in parallel/used.py) in fp32.
# Every receiver, the sender included, dequantizes the same bytes, so all ranks hold the
# same values; what was quantized (a master shard, a gradient) is never modified.


def chunk_of(numel: int, p: int) -> int:
    """Values each rank owns in `all_reduce_int8` of `numel` values (the last zero-padded)."""
    return -(-numel // p)


def n_blocks(numel: int, block: int) -> int:
    return max(1, -(-numel // block))


def row_bytes(numel: int, block: int, tail: int = 0) -> int:
    """Bytes of one packed row holding `numel` quantized values and `tail` exact fp32 ones."""
    nb = n_blocks(numel, block)
    return nb * block + 4 * nb + 4 * tail


TINY = 2.0**-96  # below it a block's step m / 127 would be subnormal: [Note: int8 blocks]
SHIFT = 2.0**32  # exact: m * SHIFT / 127 is normal for every m > 0 below TINY


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n) floats -> (..., nb * block) int8 and (..., nb) fp32 scales (each block's
    largest magnitude), per block ([Note: int8 blocks])."""
    n = x.shape[-1]
    nb = n_blocks(n, block)
    if n == nb * block and x.dtype == torch.float32 and x.is_contiguous():
        blocks = x.view(*x.shape[:-1], nb, block)  # no padding: no copy
    else:
        padded = x.new_zeros((*x.shape[:-1], nb * block), dtype=torch.float32)
        padded[..., :n] = x
        blocks = padded.view(*x.shape[:-1], nb, block)
    peak = blocks.abs().amax(dim=-1)  # (..., nb); inf or NaN with a non-finite value
    q = blocks / peak.unsqueeze(-1)  # in [-1, 1]; NaN where 0 / 0 or non-finite
    # a NaN (an all-zero or non-finite block) becomes 0; the scale keeps the block visible
    q.mul_(QMAX).round_().nan_to_num_(0.0)
    return q.to(torch.int8).view(*x.shape[:-1], nb * block), peak


def _steps(peak: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, two factors whose product is the step peak / 127: a normal fp32 one and
    an exact power of two ([Note: int8 blocks]). A non-finite peak keeps its inf or NaN."""
    tiny = peak < TINY
    step = torch.where(tiny, peak * SHIFT, peak) / QMAX
    return step, torch.where(tiny, 1 / SHIFT, 1.0)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The inverse of `quantize`: (..., nb * block) int8, (..., nb) -> (..., numel) fp32,
    or into `out` (..., numel) in its dtype. An fp32 `out` that the blocks fill exactly
    is written in place, with no temporary."""
    nb = scale.shape[-1]
    shape = (*q.shape[:-1], nb, q.shape[-1] // nb)
    step, shift = (t.unsqueeze(-1) for t in _steps(scale))
    if out is not None and out.dtype == torch.float32 and out.shape[-1] == q.shape[-1]:
        blocks = torch.mul(q.view(shape), step, out=out.view(shape))
        blocks.mul_(shift)
        return out
    blocks = q.view(shape) * step  # fp32
    blocks.mul_(shift)
    values = blocks.view(*q.shape[:-1], -1)[..., :numel]
    if out is None:
        return values
    return out.copy_(values)


def pack(
    x: torch.Tensor,
    block: int,
    tail: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
) -> torch.Tensor:
    """(R, n) floats (and an (R, t) exact tail) -> (R, row_bytes) uint8 rows, quantized
    row by row (the fp32 temporaries are one row's). With `error` (R, n) fp32, error
    feedback: it is added to `x` before quantizing and then holds this quantization's
    error (zero where that is not finite, so an fp16 overflow skips one step and does not
    poison the next ones)."""
    rows, n = x.shape
    t = 0 if tail is None else tail.shape[-1]
    nb = n_blocks(n, block)
    out = torch.empty(rows, row_bytes(n, block, t), dtype=torch.uint8, device=x.device)
    for r in range(rows):
        xr = x[r : r + 1] if error is None else x[r : r + 1].float() + error[r : r + 1]
        q, scale = quantize(xr, block)
        if error is not None:
            err = xr - dequantize(q, scale, n)
            error[r : r + 1].copy_(torch.where(torch.isfinite(err), err, 0.0))
        out[r, : nb * block].copy_(q.view(torch.uint8)[0])
        out[r, nb * block : nb * block + 4 * nb].copy_(scale.view(torch.uint8)[0])
        if t:
            out[r, nb * block + 4 * nb :].copy_(tail[r].float().contiguous().view(torch.uint8))
    return out


def _fields(row: torch.Tensor, n: int, block: int, tail: int):
    """One packed row -> its int8 values, fp32 scales and fp32 exact tail (views where
    aligned)."""
    nb = n_blocks(n, block)
    q = row[: nb * block].view(torch.int8)
    scale = row[nb * block : nb * block + 4 * nb].contiguous().view(torch.float32)
    exact = row[nb * block + 4 * nb :].contiguous().view(torch.float32)[:tail]
    return q, scale, exact


def unpack(
    rows: torch.Tensor, numel: int, block: int, tail: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, row_bytes) uint8 -> (R, numel) dequantized fp32 values and (R, tail) fp32."""
    nb = n_blocks(numel, block)
    q = rows[:, : nb * block].view(torch.int8)
    scale = rows[:, nb * block : nb * block + 4 * nb].contiguous().view(torch.float32)
    exact = rows[:, nb * block + 4 * nb :].contiguous().view(torch.float32)
    return dequantize(q, scale, numel), exact[:, :tail]


def _sum_into(out: torch.Tensor, rows: torch.Tensor, n: int, block: int, tail: int) -> None:
    """`out` (n + tail,) = the sum of the P packed `rows`, dequantized one at a time (one
    (n,) fp32 temporary) and added in source-rank order: the same on every run."""
    for r in range(rows.shape[0]):
        q, scale, exact = _fields(rows[r], n, block, tail)
        if r == 0:
            dequantize(q, scale, n, out=out[:n])
            out[n:].copy_(exact)
        else:
            out[:n].add_(dequantize(q, scale, n))
            out[n:].add_(exact)


class Then(Handle):
    """A collective's Handle and the step that turns its bytes into values: both done by
    `wait()`, the step on the caller's (compute) stream, after the collective."""

    __slots__ = ("_inner", "_then")

    def __init__(self, inner: Handle, then: Callable[[], None]):
        super().__init__(None)
        self._inner, self._then = inner, then

    def wait(self) -> None:
        if self.done:
            return
        self._inner.wait()
        self._then()
        self._inner = self._then = None
        self.done = True


def all_gather_int8(
    output: torch.Tensor, input: torch.Tensor, *, block: int = 256, tag: str = "", group=None
) -> Handle:
    """All ranks' `input` shards (S,) quantized once by their owner, gathered as int8 and
    dequantized into `output` (P*S,) in its dtype on every rank, the owner's own shard
    included ([Note: int8 blocks]). `input` is read at launch and left as it is."""
    p = world_size(group)
    s = input.numel()
    if output.numel() != s * p:
        raise ValueError(f"all_gather_int8: output has {output.numel()} elements, not {p} x {s}")
    if p == 1:  # one rank: nothing travels, nothing to quantize
        return all_gather(output, input.detach().to(output.dtype), tag=tag, group=group)
    mine = pack(input.detach().reshape(1, s), block).view(-1)  # (row_bytes,)
    rows = mine.new_empty(p, mine.numel())  # (P, row_bytes)
    handle = all_gather(rows.view(-1), mine, tag=tag, group=group)

    def dequantized() -> None:
        out = output.view(p, s)
        for r in range(p):  # row by row, into `output` (a temporary only if unaligned)
            q, scale, _ = _fields(rows[r], s, block, 0)
            dequantize(q, scale, s, out=out[r])

    return Then(handle, dequantized)


def reduce_scatter_int8(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    average: bool = False,
    block: int = 256,
    exact_tail: int = 0,
    error: torch.Tensor | None = None,
    tag: str = "",
    group=None,
) -> Handle:
    """Rank r receives the sum (or mean) of every rank's r-th 1/P slice of flat `input`:
    each slice quantized once by its sender, exchanged in one all-to-all and summed in
    fp32 by its owner in source-rank order (one quantization per value, not one per ring
    hop). The last `exact_tail` values of each slice travel exactly ([Note: int8 blocks]).
    `error` (P, S - exact_tail) fp32: error feedback, see `pack`."""
    p = world_size(group)
    width = output.numel()
    if input.numel() != width * p:
        raise ValueError(
            f"reduce_scatter_int8: input has {input.numel()} elements, expected {p} x {width}"
        )
    if p == 1:  # one rank: its own values are the sum, exact
        return reduce_scatter(output, input, average=average, tag=tag, group=group)
    n = width - exact_tail
    rows = input.detach().view(p, width)
    send = pack(rows[:, :n], block, rows[:, n:] if exact_tail else None, error)  # (P, row_bytes)
    received = torch.empty_like(send)
    handle = all_to_all(received, send, tag=tag, group=group)

    def summed() -> None:
        _sum_into(output, received, n, block, exact_tail)
        if average and p > 1:
            output.div_(p)

    return Then(handle, summed)


def prepare_all_reduce_int8(group=None) -> None:
    """Make the group `all_reduce_int8` over `group` sends its AllGathers on, on Gloo (a
    twin of `group`, [Note: int8 AllReduce in two chained phases]): every rank must call
    it at the same point, as groups.gather_group says (engines: when they are built).
    `all_reduce_int8` makes it too when it is missing, which is at the same point only
    where every rank launches the same collectives in the same order."""
    if world_size(group) > 1 and dist.get_backend(group) == "gloo":
        gather_group(group, "int8")


# [Note: int8 AllReduce in two chained phases]
# all_reduce_int8 is a ReduceScatter (int8 all-to-all, fp32 sum at each chunk's owner) and
# an AllGather of the owner's sum, quantized once more. The second phase needs the first's
# bytes, and must not wait for the caller's wait(): ddp launches a bucket during backward
# and waits for it after, so a second phase started at wait() would send every bucket's
# second half after backward, one after another, none of it overlapping compute. It is
# chained on the first ([Note: a collective chained on another] in collectives.py): on
# CUDA queued behind the all-to-all on the comm stream at launch; on CPU launched by the
# continuation thread as soon as the all-to-all has arrived, over a twin of `group`
# (`prepare_all_reduce_int8`), since the caller keeps launching on `group` meanwhile.
# Both phases go through collectives.py's launch path (bytes counted, traced, the
# simulated link) as any collective does.
# No fp32 copy of the whole tensor: the rows sent are packed from the tensor's own chunks
# (only a chunk past its end is zero-padded, one chunk's temporary), the sum and its
# quantization are one chunk's, and the gathered rows are dequantized straight into the
# tensor at wait(). The quantized bytes, the summation order and so the result are what
# a copy, padded whole, would give: each chunk is quantized alone either way.


# [Note: error feedback on both roundings]
# all_reduce_int8 rounds each value twice: every rank its chunks for the all-to-all, and
# each chunk's owner the sum (or mean) it AllGathers. Error feedback corrects both. `error`
# (P, chunk), one row per destination, holds what this rank's last send rounded away;
# `owner_error` (chunk,) what its last AllGather rounded away of the chunk it owns, added
# to its next sum before it is quantized. Over K reductions of a bucket the sum of what
# every rank received is then the sum of the true sums (or means), less what the last
# round left in both buffers: -(sum, or mean, over ranks of `error`'s rows for that
# chunk) - `owner_error`; it no longer grows with K. The owner's buffer is in the units
# of what it quantizes, the sum or mean of the ranks' (loss-scaled) gradients, which
# are those of `error`: a new loss scale rescales both alike. It is 1/P of the tensor:
# each rank rounds only the chunk it owns. On CPU it is read and written by the
# continuation thread that launches the AllGather, so nothing else may touch it until
# the Handle is waited for (nothing does: it is rescaled and saved after the step).


def all_reduce_int8(
    tensor: torch.Tensor,
    *,
    average: bool = False,
    block: int = 256,
    exact_tail: int = 0,
    error: torch.Tensor | None = None,
    owner_error: torch.Tensor | None = None,
    tag: str = "",
    group=None,
) -> Handle:
    """Sum (or average) flat `tensor` over ranks in place, as a ring AllReduce is a
    ReduceScatter and an AllGather: each rank's 1/P chunk is quantized, exchanged in one
    all-to-all and summed in fp32 by its owner, which quantizes the sum once and
    all-gathers it as int8; every rank, the owner included, keeps the dequantized result.
    The last `exact_tail` values go exactly to every rank in the same all-to-all and are
    summed there. The AllGather is launched as soon as the all-to-all has arrived, not at
    wait() ([Note: int8 AllReduce in two chained phases]); `tensor` is read at launch and
    written at wait(). Error feedback ([Note: error feedback on both roundings]): `error`
    (P, chunk) fp32 on the first quantization, `owner_error` (chunk,) fp32 on the second,
    that of this rank's own chunk's sum (or mean); see `pack`."""
    p = world_size(group)
    if p == 1:  # the sum (and mean) over one rank is the tensor itself
        return all_reduce(tensor, tag=tag, group=group)
    n = tensor.numel() - exact_tail
    chunk = chunk_of(n, p)
    if owner_error is not None and owner_error.numel() != chunk:
        raise ValueError(
            f"all_reduce_int8: owner_error has {owner_error.numel()} elements, not {chunk}"
        )
    flat = tensor.detach().view(-1)
    tail = flat[n:].float().view(1, exact_tail) if exact_tail else None
    send = flat.new_empty((p, row_bytes(chunk, block, exact_tail)), dtype=torch.uint8)
    for r in range(p):  # chunk by chunk from `flat`: no copy of it
        lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
        values = flat[lo:hi]
        if hi - lo < chunk:  # past the end: zero-padded, one chunk's temporary
            values = torch.cat([values.float(), values.new_zeros(chunk - hi + lo).float()])
        err = None if error is None else error[r : r + 1]
        send[r].copy_(pack(values.view(1, chunk), block, tail, err)[0])
    received = torch.empty_like(send)
    exchanged = all_to_all(received, send, tag=tag, group=group)
    # the AllGather's group: on CPU the twin that only the continuation thread uses
    twin = group if flat.is_cuda else gather_group(group, "int8")
    rows = send.new_empty(p, row_bytes(chunk, block))  # (P, row_bytes): every owner's sum
    mine = flat.new_empty(chunk + exact_tail, dtype=torch.float32)  # this rank's chunk, tail

    def summed_and_gathered() -> Handle:
        _sum_into(mine, received, chunk, block, exact_tail)
        if not flat.is_cuda:  # done with: freed now, not when Gloo's thread lets go
            free_storage(received)
            free_storage(send)
        if average and p > 1:
            mine.div_(p)
        kept = None if owner_error is None else owner_error.view(1, chunk)
        packed = pack(mine[:chunk].view(1, chunk), block, error=kept).view(-1)  # (row_bytes,)
        return all_gather(rows.view(-1), packed, tag=tag, group=twin)

    handle = chain(exchanged, summed_and_gathered, group)

    def dequantized() -> None:
        for r in range(p):  # row by row, into `flat` (a temporary only if unaligned)
            lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
            q, scale, _ = _fields(rows[r], chunk, block, 0)
            if hi > lo:
                dequantize(q, scale, hi - lo, out=flat[lo:hi])
        flat[n:].copy_(mine[chunk:])

    return Then(handle, dequantized)
