"""Expert parallelism: each rank holds n_experts / E of every MoE layer's experts, and
tokens travel to the rank of the experts their router picked, then back.

    route (every rank, its own tokens)            top-k experts and weights per token
    counts  AllToAll(per-expert counts)           how many rows each rank will send me
            one host read of the split sizes      (counted: host.tolist)
    tokens  AllToAll(rows, uneven splits)         rows grouped by source rank, then expert
            permute to expert order, run every local expert (zero rows too), permute back
    back    AllToAll(results, splits reversed)    each rank gets its rows' results
    combine weighted sum of each token's k results

Backward is the reverse: the gradient of `back` goes through a tokens-shaped AllToAll and
the gradient of `tokens` through a back-shaped one (`_AllToAll`, an autograd function
over trainer.comm, so bytes are counted and the test hooks see them; on CUDA they run on
the comm stream). Three AllToAlls per MoE layer in forward, two in backward, over the
layer's EP group only ([Note: expert parallel groups] in comm/groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer import comm
from trainer.comm.groups import ExpertGroups, check_expert_parallel, expert_groups
from trainer.errors import ConfigError
from trainer.models.materialize import Request, Source, param_owners, swap_into
from trainer.observe import host


@dataclass(frozen=True)
class Placement:
    """Where an experts module's experts live: which ones this rank holds and the EP
    group that exchanges tokens. Set on the module as `module.placement` (None: one
    process holds all of them, no collectives)."""

    group: torch.distributed.ProcessGroup
    size: int  # E: ranks of the EP group
    rank: int  # this rank's position in it
    n_experts: int  # experts of the layer, on all E ranks together
    n_local: int  # n_experts / E, held here: experts [rank * n_local, (rank + 1) * n_local)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules ([Note: expert parameters in every mode]): an integer
    `num_experts`, every direct parameter stacked over them, and a forward that expert
    parallelism can take over: ours (a `placement` attribute: GPT-MoE's `Experts`) or
    one behind transformers' experts interface (`@use_experts_implementation`, which
    gives it `is_concatenated`). A router's weight (n, C) is stacked too: it has neither."""
    found = []
    for name, m in model.named_modules():
        n = getattr(m, "num_experts", None)
        own = [p for p in m._parameters.values() if p is not None]
        if (
            isinstance(n, int)
            and n > 0
            and own
            and all(p.dim() >= 1 and p.shape[0] == n for p in own)
            and (hasattr(m, "placement") or _hf_interface(m))
        ):
            found.append((name, m))
    return found


@dataclass(frozen=True)
class MoEShape:
    """What the traffic of expert parallelism depends on (scripts/estimate.py)."""

    layers: int  # MoE layers
    n_experts: int  # experts per layer
    top_k: int  # experts per token
    hidden: int  # C: the size of a token's row
    expert_params: int  # parameters of every layer's experts together


def moe_shape(model: nn.Module) -> MoEShape | None:
    """The MoE layers of `model` (ours or Hugging Face's, on meta too), or None."""
    modules = expert_modules(model)
    if not modules:
        return None
    config = getattr(modules[0][1], "config", None)  # a Hugging Face experts module's
    if config is not None:
        top_k, hidden = config.num_experts_per_tok, config.hidden_size
    else:  # GPT-MoE: the MoE module holding the experts
        moe = next(m for m in model.modules() if getattr(m, "experts", None) is modules[0][1])
        top_k, hidden = moe.top_k, moe.router.in_features
    params = sum(p.numel() for _, m in modules for p in m.parameters(recurse=False))
    return MoEShape(len(modules), modules[0][1].num_experts, top_k, hidden, params)


def all_to_all_bytes(shape: MoEShape, e: int, tokens: int, element: int, passes: int) -> float:
    """Bytes one rank sends in AllToAlls per step, balanced routing: per MoE layer and
    pass (a forward or a backward) the rows out and their results back, each row to
    another rank with probability (E-1)/E; `tokens` this rank's per step, `passes` 2
    (forward, backward) or 3 (with activation checkpointing). The counts (n integers
    per layer and forward) are left out."""
    rows = tokens * shape.top_k
    return passes * shape.layers * 2 * (e - 1) / e * rows * shape.hidden * element


def active_params(model: nn.Module, psi: int) -> int:
    """Of the model's Ψ = `psi` parameters, those one token's forward multiplies by, for
    6 x that FLOPs per token (forward and backward): every dense parameter (routers and
    shared experts included: those run for every token) and top_k / n_experts of the
    stacked experts, the k a token is routed to. Ψ for a model without experts."""
    shape = moe_shape(model)
    if shape is None:
        return psi
    return psi - shape.expert_params + shape.expert_params * shape.top_k // shape.n_experts


def routes_in_fake_tensors(model: nn.Module) -> bool:
    """Whether a forward of `model` runs in fake tensors, its MoE layers routing through
    dispatch_combine ([Note: routing in a pass without values]): GPT-MoE's and models
    without experts do. transformers' experts do not: their eager forward finds the
    experts that got rows with `nonzero` (a shape from values), their grouped_mm one
    takes bf16/fp16 only on a CPU."""
    return not any(_hf_interface(m) for _, m in expert_modules(model))


def _hf_interface(m: nn.Module) -> bool:
    """Whether `m` is a transformers experts class behind its experts interface."""
    return hasattr(m, "is_concatenated") and hasattr(m, "config")


@dataclass
# [Note: expert parameters in every mode]
# An experts module is one whose direct parameters are stacked over experts: leading
# dimension `num_experts` (our GPT-MoE's `Experts`, transformers' `*Experts` classes). With
# `mode.expert_parallel=E` each rank keeps rows [r*n/E, (r+1)*n/E) of them, r its position
# in its EP group, and the modes treat them as they treat every parameter, over the EDP
# group instead of all ranks: ddp AllReduces their buckets there, zero ReduceScatters and
# AllGathers their buckets there, fsdp shards each unit's experts there and gathers them
# with the unit. Dense parameters are handled over all P ranks as always.
class ExpertPlan:
    """What expert parallelism does to a model: its experts modules, their parameters
    (by name, as `model.named_parameters()` lists them) and the groups."""

    groups: ExpertGroups
    modules: list[tuple[str, nn.Module]]
    names: list[str]
    params: list[nn.Parameter]
    full_shapes: dict[str, torch.Size]  # each expert parameter's shape over all experts

    def __post_init__(self) -> None:
        self.ids = {id(p) for p in self.params}

    def holds(self, p: Tensor) -> bool:
        """Whether `p` is an expert parameter (sharded over EP, reduced over EDP)."""
        return id(p) in self.ids

    def gather_rows(self, whole: dict[str, Tensor], device: torch.device) -> None:
        """Each expert parameter of `whole` (CPU copies of the rows this rank's EP
        position holds) replaced by all its rows, gathered over the EP group into the
        model's own layout (every expert, stacked). A collective over the EP group."""
        ep = self.groups.ep_size
        for name in self.names:
            rows = whole[name].to(device)
            gathered = rows.new_empty((ep * rows.numel(),))
            comm.all_gather(
                gathered, rows.contiguous().view(-1), tag="state", group=self.groups.ep
            ).wait()
            whole[name] = gathered.view(ep * rows.shape[0], *rows.shape[1:]).cpu()


def plan(model: nn.Module, e: int, shard_group_size: int | None = None) -> ExpertPlan | None:
    """The plan for `mode.expert_parallel=E`; None for E = 1 (experts are dense
    parameters then). Refuses in one line a value that does not divide both the world
    size and every layer's number of experts, a model without experts, and hybrid
    sharding."""
    if e == 1 and not isinstance(e, bool):
        return None
    p = comm.world_size()
    modules = expert_modules(model)
    if not modules:
        check_expert_parallel(e, p)
        raise ConfigError(
            f"mode.expert_parallel={e!r} needs a model with MoE layers (model=gpt_moe, or a "
            "Hugging Face MoE model); this model has no experts module: use 1"
        )
    for n in sorted({m.num_experts for _, m in modules}):
        check_expert_parallel(e, p, n)
    if shard_group_size is not None and shard_group_size != p:
        raise ConfigError(
            f"mode.expert_parallel={e} with mode.shard_group_size={shard_group_size}: hybrid "
            "sharding with expert parallelism is not supported; set one of them to null/1"
        )
    groups = expert_groups(e)
    named = expert_parameters(model, modules)
    shapes = {n: q.shape for n, q in named}
    return ExpertPlan(groups, modules, [n for n, _ in named], [q for _, q in named], shapes)


def expert_parameters(
    model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
) -> list[tuple[str, nn.Parameter]]:
    """The parameters of `model`'s experts modules (`expert_modules`), named as
    `model.named_parameters()` names them (on meta too)."""
    modules = expert_modules(model) if modules is None else modules
    owned = {id(m) for _, m in modules}
    owners = param_owners(model)
    by_module = {name: m for name, m in modules}
    return [
        (n, q) for n, q in model.named_parameters() if id(by_module.get(owners[id(q)][0])) in owned
    ]


def shard(model: nn.Module, ep: ExpertPlan, source: Source | None, device: torch.device) -> None:
    """Keep this rank's rows of every expert parameter: sliced from the full values (a
    model built ordinarily, the same on every rank after build_engine's broadcast), or
    read from `source` for those rows only (a model built on meta: a Pretrained source
    reads only these experts' tensors). Sets each experts module's `placement`."""
    g = ep.groups
    requests, local = [], []
    for name, p in zip(ep.names, ep.params, strict=True):
        n_local = p.shape[0] // g.ep_size
        lo, hi = g.ep_rank * n_local, (g.ep_rank + 1) * n_local
        if p.is_meta:
            row = p[0].numel()
            values = torch.empty((n_local, *p.shape[1:]), dtype=p.dtype, device=device)
            requests.append(Request(name, p, lo * row, hi * row, values.view(-1)))
        else:
            values = p.detach()[lo:hi].clone()
        local.append(values)
    if requests:
        if source is None:
            raise ConfigError("expert parameters on the meta device need a source")
        source.fill(model, [], requests, device)
    for p, values in zip(ep.params, local, strict=True):
        if p.is_meta:
            swap_into(p, values)
        else:  # the same tensor keeps its hooks: hooks registered on a parameter before
            # build_engine stay, and so do those registered after (a swapped tensor's
            # post-accumulate-grad hooks never fire, the engine's own included)
            p.data = values
    for _, m in ep.modules:
        if _hf_interface(m):
            use_ep_implementation(m)
        m.placement = Placement(
            g.ep, g.ep_size, g.ep_rank, m.num_experts, m.num_experts // g.ep_size
        )


# [Note: expert gradient scale]
# The loss is the mean over the P ranks of each rank's loss. An expert's gradient on its
# rank is, through the backward AllToAlls, the sum of the gradients of the E losses of the
# EP group's ranks (the tokens it served came from them). Averaging that over the P/E
# ranks of the EDP group would give E times the true gradient (DeepSpeed #5618/#6545,
# pytorch#160285): each expert parameter's gradient is divided by E where it is produced
# (a tensor hook, before it accumulates), and the EDP average divides by P/E: 1/P in all.
def scale_gradients(ep: ExpertPlan) -> None:
    """Divide each expert parameter's gradient by E as it is produced ([Note: expert
    gradient scale])."""
    e = ep.groups.ep_size
    for p in ep.params:
        p.register_hook(lambda grad: grad / e)


# ---------------------------------------------------------------------------------------
# Dispatch and combine


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of the EP group by uneven splits; backward sends the gradient
    rows back the way they came (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group, tag: str):
        ctx.splits, ctx.group, ctx.tag = (out_splits, in_splits), group, tag
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, tag=tag, group=group).wait()
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        handle = comm.all_to_all(
            g, grad.contiguous(), in_splits, out_splits, tag=f"{ctx.tag}.grad", group=ctx.group
        )
        handle.wait()
        return g, None, None, None, None


# run_local(rows, counts): rows (N, C) grouped by local expert, counts[e] rows each
RunLocal = Callable[[Tensor, list[int]], Tensor]

# [Note: routing in a pass without values]
# The estimate (trainer/estimate/activations.py) runs one forward and backward in fake
# tensors: shapes without values. Routing has values: the split sizes of the experts'
# rows are read on the host (`counts`), which a fake tensor cannot give. Under
# `balanced_routing()` dispatch_combine takes, for a layer without placement, the sizes
# of a balanced routing instead: the T·k rows spread evenly over the experts, what the
# load-balancing loss steers to. Nothing else changes, and the bytes do not depend on the
# split: every expert's tensors hold (rows of that expert) x (its widths), so the sum over
# experts is that of T·k rows whatever the routing (tests/test_estimate.py measures a real
# pass against it). The counts themselves are taken with `expert_counts`, whose output is
# (n,) whatever the ids (torch.bincount's shape depends on the largest id: no fake tensor
# can hold it). Under expert parallelism a rank's experts receive T·k rows when routing is
# balanced, the same bytes; the AllToAll buffers in flight and an unbalanced routing (a
# rank receiving more than its share) come on top.
_balanced = False


@contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside: split sizes of a balanced routing ([Note: routing in a pass without values])."""
    global _balanced
    before, _balanced = _balanced, True
    try:
        yield
    finally:
        _balanced = before


def expert_counts(ids: Tensor, n: int) -> Tensor:
    """Rows per expert (n,) of the expert ids `ids`: torch.bincount(ids, minlength=n),
    by an op whose output shape does not depend on the values ([Note: routing in a pass
    without values])."""
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def _balanced_sizes(rows: int, n: int) -> list[int]:
    """`rows` spread over `n` experts as evenly as whole numbers allow."""
    return [rows // n + (1 if e < rows % n else 0) for e in range(n)]


def dispatch_combine(
    x: Tensor, top_idx: Tensor, top_w: Tensor, run_local: RunLocal, n_experts: int,
    placement: Placement | None,
) -> Tensor:  # fmt: skip
    """Route each token (x: (T, C)) to its k experts (top_idx, top_w: (T, k)), run them
    wherever they live, and return the weighted sum of their outputs (T, C).

    Every local expert runs, on zero rows too, and every rank issues the same
    collectives whatever the counts: no collective depends on a token count."""
    t, c = x.shape
    k = top_idx.shape[1]
    flat = top_idx.reshape(-1)  # (T*k,)
    order = torch.argsort(flat, stable=True)  # (T*k,) rows grouped by expert
    token = order // k  # (T*k,) the token each row belongs to
    counts = expert_counts(flat, n_experts)  # (n_experts,)
    rows = x[token]  # (T*k, C)
    if placement is None and _balanced:  # [Note: routing in a pass without values]
        out = run_local(rows, _balanced_sizes(t * k, n_experts))
    elif placement is None:
        out = run_local(rows, host.tolist(counts, "expert split sizes"))
    else:
        out = _exchange(rows, counts, run_local, placement)  # (T*k, C)
    weights = top_w.reshape(-1)[order].to(out.dtype)  # (T*k,)
    y = x.new_zeros((t, c), dtype=out.dtype)
    return y.index_add(0, token, out * weights[:, None])  # (T, C)


def _exchange(rows: Tensor, counts: Tensor, run_local: RunLocal, pl: Placement) -> Tensor:
    """rows (T*k, C) sorted by global expert -> their experts' outputs, same order."""
    e, nl = pl.size, pl.n_local
    received = torch.empty_like(counts)  # (E * n_local,): each source's counts for mine
    comm.all_to_all(received, counts, tag="moe.counts", group=pl.group).wait()
    # The one host read of the layer: the split sizes of both AllToAlls.
    sizes = host.tolist(torch.cat([counts, received]), "expert split sizes")
    send, recv = sizes[: e * nl], sizes[e * nl :]
    in_splits = [sum(send[j * nl : (j + 1) * nl]) for j in range(e)]  # to each rank
    out_splits = [sum(recv[s * nl : (s + 1) * nl]) for s in range(e)]  # from each rank
    got = _AllToAll.apply(rows, out_splits, in_splits, pl.group, "moe.tokens")
    index = _expert_major(recv, e, nl).to(rows.device)  # a copy to the device, not a read
    local_counts = [sum(recv[s * nl + j] for s in range(e)) for j in range(nl)]
    out = run_local(got[index], local_counts)  # (R, C) expert-major
    back = torch.empty_like(out).index_copy(0, index, out)  # source-major again
    return _AllToAll.apply(back, in_splits, out_splits, pl.group, "moe.back")


def _expert_major(recv: list[int], e: int, nl: int) -> Tensor:
    """Received rows come source-major (source s's rows for my expert 0, 1, ...); the
    experts want them expert-major. Returns, expert by expert and source by source, the
    positions of the rows in the received order (computed on the host, from the sizes
    read already)."""
    sizes = torch.tensor(recv, dtype=torch.long).view(e, nl)  # (E, n_local)
    starts = (sizes.flatten().cumsum(0) - sizes.flatten()).view(e, nl)  # where each lies
    lengths, firsts = sizes.t().flatten(), starts.t().flatten()  # (n_local * E,) expert-major
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # segment of each row
    within = torch.arange(seg.numel()) - (lengths.cumsum(0) - lengths)[seg]
    return firsts[seg] + within


# ---------------------------------------------------------------------------------------
# Hugging Face experts: transformers' experts interface

# [Note: Hugging Face experts under expert parallelism]
# transformers 5 puts the experts of 67 MoE families behind one interface: the class is
# decorated with `@use_experts_implementation`, and its forward(hidden_states (T, C),
# top_k_index (T, k), top_k_weights (T, k)) looks up `config._experts_implementation` in
# `ALL_EXPERTS_FUNCTIONS`, where a function can be registered by name. EP_IMPLEMENTATION
# is ours: `dispatch_combine` sends each token to the rank of its experts, and there the
# class's own forward (transformers' eager expert math: gate/up, activation, down) runs
# on the received rows, each row given its local expert id and weight 1; the routing
# weights are applied when the rows come back. HF's eager forward skips an expert that
# got no row, so a rank that received none for some expert adds a zero times the sum of
# its expert parameters: every expert gets a gradient, zero where it saw no token.
EP_IMPLEMENTATION = "shardtrain_expert_parallel"


def _ep_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The registered experts forward ([Note: Hugging Face experts under expert
    parallelism])."""
    own_forward = type(self).forward.__wrapped__  # the class's forward, under the interface

    def run_local(rows: Tensor, counts: list[int]) -> Tensor:
        ids = torch.repeat_interleave(
            torch.arange(len(counts), device=rows.device),
            torch.tensor(counts, device=rows.device),
        )  # (N,) the local expert of each row
        out = own_forward(self, rows, ids[:, None], rows.new_ones((rows.shape[0], 1)))
        if 0 in counts:
            untouched = sum(p.sum() for p in self._parameters.values() if p is not None)
            out = out + 0.0 * untouched
        return out  # (N, C)

    return dispatch_combine(
        hidden_states, top_k_index, top_k_weights, run_local, self.num_experts, self.placement
    )


def use_ep_implementation(module: nn.Module) -> None:
    """Register EP_IMPLEMENTATION with transformers and make `module`'s config use it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EP_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EP_IMPLEMENTATION, _ep_experts_forward)
    if not hasattr(type(module).forward, "__wrapped__"):
        raise ConfigError(
            f"{type(module).__name__}: its forward is not transformers' experts interface "
            "(@use_experts_implementation); expert parallelism cannot run it"
        )
    module.config._experts_implementation = EP_IMPLEMENTATION
