"""A process group in Python, seen from one rank, that completes each collective on fake
CUDA tensors (cuda.py): the rehearsal's NCCL.

[Note: a world of one rank]
One process plays rank r of P. Each torch.distributed function trainer/comm/ calls is
replaced for the block: groups are lists of global ranks (`new_group`,
`new_subgroups_by_enumeration` as torch builds them), and a collective checks what NCCL
would refuse (a tensor not on this rank's GPU, sizes that do not split over the group,
dtypes that differ) and then runs, as NCCL does, on a stream of its own per group: it
waits for the stream current at the launch, reads its inputs and writes its outputs
there; `work.wait()` orders the then current stream after it. Values are not computed
(the tensors have none); object collectives hand back this rank's own objects, as if
every rank had said the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from trainer.comm import all_to_all, collectives
from trainer.rehearse import cuda
from trainer.rehearse.cuda import Violation, checker, is_fake_cuda, where
from trainer.rehearse.patches import Patches


class Group:
    def __init__(self, ranks: list[int], name: str) -> None:
        self.ranks, self.name = list(ranks), name

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"group {self.name} {self.ranks}"


class Work:
    """An NCCL work handle: `wait()` orders the current stream after the collective."""

    def __init__(self, clock: dict | None) -> None:
        self.clock = clock

    def wait(self, timeout: Any = None) -> bool:
        if self.clock is not None:
            cuda.merge_clock(cuda.current_stream().clock, self.clock)
        return True

    def is_completed(self) -> bool:
        return True


class World:
    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size}")
        self.rank, self.size = rank, size
        self.world = Group(list(range(size)), "world")
        self.groups = 0
        self.nccl: dict[int, cuda.Stream] = {}  # NCCL's stream, per group
        self.launching = ("", "")  # (op, tag) of the collective being launched
        self.calls: list[tuple[str, str, int]] = []  # (op, tag, group size)

    def _group(self, group: Group | None) -> Group:
        return self.world if group is None else group

    def get_rank(self, group: Group | None = None) -> int:
        g = self._group(group)
        return g.ranks.index(self.rank) if self.rank in g.ranks else -1

    def get_world_size(self, group: Group | None = None) -> int:
        return self._group(group).size()

    def new_group(self, ranks: list[int] | None = None, **_: Any) -> Group:
        self.groups += 1
        return Group(list(range(self.size)) if ranks is None else ranks, str(self.groups))

    def new_subgroups_by_enumeration(self, ranks_per_subgroup_list, **_: Any):
        subgroups, mine = [], None
        for ranks in ranks_per_subgroup_list:
            g = self.new_group(ranks)
            subgroups.append(g)
            if self.rank in ranks:
                mine = g
        return mine, subgroups

    def get_process_group_ranks(self, group: Group | None) -> list[int]:
        return list(self._group(group).ranks)

    # -- the collectives -----------------------------------------------------------------
    def _run(self, op: str, group: Group | None, reads, writes) -> Work:
        g = self._group(group)
        if self.rank not in g.ranks:
            raise Violation(f"{op} over {g}, which rank {self.rank} is not in, at {where()}")
        c = checker()
        c.poll()
        tensors = [t for t in list(reads) + list(writes) if t is not None]
        for t in tensors:
            if not is_fake_cuda(t):
                c.fail(
                    f"{op} '{self.launching[1]}' is given a tensor on {t.device} at {where()}: "
                    "NCCL communicates CUDA tensors only (an allocation without device=?)"
                )
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1 and op not in ("all_to_all_single",):
            c.fail(
                f"{op} '{self.launching[1]}' mixes dtypes {sorted(map(str, dtypes))} at {where()}"
            )
        tag = self.launching[1] if self.launching[0] in op else ""
        self.calls.append((op, tag, g.size()))
        if id(g) not in self.nccl:
            self.nccl[id(g)] = c.new_stream(name=f"NCCL's stream of {g}")
        nccl = self.nccl[id(g)]
        nccl.wait_stream(cuda.current_stream())  # NCCL waits for the launching stream
        nccl.tick()
        at = where(skip=("comm/collectives.py", "comm/all_to_all.py", "comm/quantized.py"))
        for t in reads:
            if t is not None:
                c.access(t, nccl, False, f"{op} '{tag}' (input)", at)
                c.watch(t)
        for t in writes:
            if t is not None:
                c.access(t, nccl, True, f"{op} '{tag}' (output)", at)
                c.watch(t)
        return Work(dict(nccl.clock))

    @staticmethod
    def _done(work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return self._done(self._run("all_reduce", group, [tensor], [tensor]), async_op)

    def reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):
        p = self.get_world_size(group)
        if input.numel() != output.numel() * p:
            checker().fail(f"reduce_scatter: {input.numel()} elements != {p} x {output.numel()}")
        return self._done(self._run("reduce_scatter", group, [input], [output]), async_op)

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        p = self.get_world_size(group)
        if output.numel() != input.numel() * p:
            checker().fail(f"all_gather: {output.numel()} elements != {p} x {input.numel()}")
        return self._done(self._run("all_gather", group, [input], [output]), async_op)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        return self._done(self._run("broadcast", group, [tensor], [tensor]), async_op)

    def reduce(self, tensor, dst=0, group=None, async_op=False):
        return self._done(self._run("reduce", group, [tensor], [tensor]), async_op)

    def gather(self, tensor, gather_list=None, dst=0, group=None, async_op=False):
        outs = list(gather_list or [])
        if outs and len(outs) != self.get_world_size(group):
            checker().fail(f"gather: {len(outs)} outputs for {self.get_world_size(group)} ranks")
        return self._done(self._run("gather", group, [tensor], outs), async_op)

    def scatter(self, tensor, scatter_list=None, src=0, group=None, async_op=False):
        return self._done(self._run("scatter", group, list(scatter_list or []), [tensor]), async_op)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
        async_op=False,
    ):  # fmt: skip
        p = self.get_world_size(group)
        for t, splits, side in (
            (input, input_split_sizes, "input"),
            (output, output_split_sizes, "output"),
        ):
            if splits:
                if len(splits) != p or sum(splits) != t.shape[0]:
                    checker().fail(
                        f"all_to_all '{self.launching[1]}': {side} splits {list(splits)} do not "
                        f"cut {t.shape[0]} rows over {p} ranks, at {where()}"
                    )
            elif t.shape[0] % p:
                checker().fail(f"all_to_all: {t.shape[0]} rows do not split over {p} ranks")
        if input.dtype != output.dtype:
            checker().fail(f"all_to_all: {input.dtype} in, {output.dtype} out, at {where()}")
        return self._done(self._run("all_to_all_single", group, [input], [output]), async_op)

    def barrier(self, group=None, async_op=False, **_: Any):
        return self._done(self._run("barrier", group, [], []), async_op)

    def broadcast_object_list(self, object_list, src=0, group=None, **_: Any) -> None:
        self.calls.append(("broadcast_object", "", self.get_world_size(group)))

    def all_gather_object(self, object_list, obj, group=None) -> None:
        self.calls.append(("all_gather_object", "", self.get_world_size(group)))
        for i in range(len(object_list)):
            object_list[i] = obj


NATIVE = {
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce",
    "gather", "scatter", "all_to_all_single", "barrier", "broadcast_object_list",
    "all_gather_object", "get_rank", "get_world_size", "new_group",
    "new_subgroups_by_enumeration", "get_process_group_ranks",
}  # fmt: skip


@contextlib.contextmanager
def fake_world(rank: int, size: int) -> Iterator[World]:
    """Install a world of `size` ranks seen from `rank` ([Note: a world of one rank]) for
    the block; torch.distributed's functions come back at its end."""
    w = World(rank, size)
    patches = Patches()
    for name in NATIVE:
        patches.set(dist, name, getattr(w, name))
    # recent torch's names for the flat collectives (collectives.NATIVE_NAMES)
    patches.set(dist, "reduce_scatter_single", w.reduce_scatter_tensor)
    patches.set(dist, "all_gather_single", w.all_gather_into_tensor)
    patches.set(dist, "is_initialized", lambda: True)
    patches.set(dist, "get_backend", lambda group=None: "nccl")
    patches.set(dist, "group", SimpleNamespace(WORLD=w.world))
    launch = collectives.launch

    def launching(op: str, tag: str, *args: Any, **kwargs: Any) -> None:
        w.launching = (op, tag)
        launch(op, tag, *args, **kwargs)

    patches.set(collectives, "launch", launching)
    patches.set(all_to_all, "launch", launching)
    try:
        yield w
    finally:
        patches.undo()
