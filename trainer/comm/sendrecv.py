"""Reduce-scatter and all-gather built from point-to-point sends: comm's Gloo fast path
([Note: p2p collectives on Gloo], below).

collectives.py decides when these run (on Gloo by default, or as forced by
`comm.p2p(...)`) and does the accounting, averaging and stream handling around them;
this module only moves the bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# [Note: p2p collectives on Gloo]
# Gloo runs reduce_scatter as a whole all-reduce and its all_gather is slow. Both are
# short to write from sends and receives that move exactly the textbook (P-1)/P of the
# full buffer per rank, the same bytes as the ring algorithm:
#
#   reduce-scatter: rank r sends its chunk j to rank j (every j != r) and receives chunk
#       r from every other rank; wait() adds those P-1 chunks to its own chunk r.
#   all-gather: rank r sends its shard to every other rank and receives theirs straight
#       into their places in `output`.
#
# All 2(P-1) messages are posted at once (one batch_isend_irecv) and the backend's
# threads move them, so the Handle is in flight while the caller computes. Every rank's
# k-th message goes k ranks ahead, so the first messages spread over all ranks instead
# of all landing on rank 0. A ring (P-1 dependent steps: receive from r-1, add, forward
# to r+1) sends the same bytes but needs a helper thread to chain its steps; it measured
# slower than this on Gloo at every size and world size tried (docs/comm_bench.md). The
# price is a receive buffer of (P-2)/P of the input per reduce-scatter in flight, (P-1)/P
# when the output is the input's own chunk (a ring needs 2/P).
# NCCL's native collectives are already bandwidth-optimal rings/trees: NCCL stays native.

_P2P_TAG = 0x50325043  # tag of these messages, apart from any other p2p traffic


class P2PWork:
    """Sends and receives in flight; `wait()` waits for all, then runs `finish`."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None):
        self._works = works
        self._finish = finish

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        return True


def _exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group
) -> list[dist.Work]:
    """Post every (tensor, group rank) send and receive at once."""
    ops = [
        dist.P2POp(dist.isend, t, group=group, tag=_P2P_TAG, group_peer=peer) for t, peer in sends
    ]
    ops += [
        dist.P2POp(dist.irecv, t, group=group, tag=_P2P_TAG, group_peer=peer) for t, peer in recvs
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> P2PWork:
    """Sum of every rank's r-th 1/P chunk of flat `input` into rank r's `output`."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = input.view(p, -1)  # (P, n): chunk j is summed on rank j
    out = output.view(-1)  # (n,); may be chunks[r] itself (in place)
    # Out of place, the first chunk received lands straight in `out`: one receive buffer
    # fewer (none at P=2) and no copy of chunks[r]; a + b == b + a, so the sum is the same.
    direct = p > 1 and out.data_ptr() != chunks[r].data_ptr()
    received = input.new_empty((p - 1 - direct, out.numel()))  # (P-1 or P-2, n)
    rows = [out, *received] if direct else list(received)  # row k-1 from rank r-k
    works = _exchange(
        [(chunks[(r + k) % p], (r + k) % p) for k in range(1, p)],
        [(rows[k - 1], (r - k) % p) for k in range(1, p)],
        group,
    )

    def finish() -> None:
        if direct:
            out.add_(chunks[r])
        elif out.data_ptr() != chunks[r].data_ptr():  # P = 1
            out.copy_(chunks[r])
        for row in received:
            out.add_(row)

    return P2PWork(works, finish)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> P2PWork:
    """Every rank's `input` shard into its place in every rank's `output`, in rank order."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(p, -1)  # (P, n): chunk j is rank j's shard
    shard = input.view(-1)  # (n,); may be chunks[r] itself (in place)
    if shard.data_ptr() != chunks[r].data_ptr():
        chunks[r].copy_(shard)
    works = _exchange(
        [(chunks[r], (r + k) % p) for k in range(1, p)],
        [(chunks[(r - k) % p], (r - k) % p) for k in range(1, p)],
        group,
    )
    return P2PWork(works)
