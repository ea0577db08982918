"""fsdp's units called in another order than they are registered, the ranks' calls
differing, against torch DDP.

fsdp's one order of collectives ([Note: one collective order on every rank] in
trainer/parallel/schedule.py) follows the order of the first forward's calls, agreed by
the ranks ([Note: the order of the calls] there). Each case trains 3 steps of 2
micro-batches (the first under no_sync, so the order is taken from a no_sync forward),
SGD, through fsdp with both reshard settings, and compares every final weight with torch
DDP (find_unused_parameters=True) on the same ranks and data:
  * reversed: every rank calls the blocks last to first, the last rank skipping one;
  * orders_by_step: each step calls the blocks in an order of its own, the last rank
    skipping one (later forwards differ from the one the order came from);
  * albert: a block registered after the others, called before each of them (ALBERT's
    weight sharing), the last rank skipping the last of the others.
And the forward of a step after the first gathers the reversed case's blocks in the order
of its calls.
"""

from __future__ import annotations

import contextlib
import functools
import random

import pytest
import torch
from dist_harness import run_distributed
from reference import assert_state_close
from torch import nn

pytestmark = pytest.mark.slow

WIDTH, OUT, BATCH_PER_RANK, STEPS, BLOCKS = 12, 3, 4, 3, 6
CASES = ("reversed", "orders_by_step", "albert")
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
MODES = {
    "fsdp": {"unit_classes": ["Block"]},
    "fsdp_keep": {"unit_classes": ["Block"], "reshard_after_forward": False},
}


class Block(nn.Module):
    """One fsdp unit."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Blocks(nn.Module):
    """An input layer, BLOCKS blocks, a block `shared` registered after them, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.shared = Block()
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor, plan: tuple) -> torch.Tensor:
        """`plan`: the blocks to call, in order: an index into `layers`, or "s" for
        `shared`."""
        h = self.inp(x)
        for step in plan:
            h = (self.shared if step == "s" else self.layers[step])(h)
        return self.head(h)


def _plans(case: str, world: int) -> list[list[tuple]]:
    """plans[step][micro][rank] for each micro-batch of each step."""
    everyone = tuple(range(BLOCKS))
    if case == "reversed":
        mine = everyone[::-1]
        plan = tuple([mine] * (world - 1) + [tuple(i for i in mine if i != 2)])
        return [[plan] * 2] * STEPS
    if case == "albert":  # skipping the last block keeps every later call of `shared` one
        each = tuple(x for i in everyone for x in ("s", i))  # after another block
        plan = tuple([each] * (world - 1) + [each[:-1]])
        return [[plan] * 2] * STEPS
    rnd = random.Random(f"orders by step, {world} ranks")
    plans = []
    for _ in range(STEPS):
        mine = tuple(rnd.sample(everyone, BLOCKS))
        skip = rnd.choice(everyone)
        plan = tuple([mine] * (world - 1) + [tuple(i for i in mine if i != skip)])
        plans.append([plan] * 2)
    return plans


def _train(env, case: str, mode: str) -> dict:
    """Train `case` through torch DDP or fsdp (`mode`); the weights, and (fsdp) the
    AllGathers of the second step's first forward."""
    from trainer import comm
    from trainer.parallel import build_engine

    model = Blocks()
    if mode == "torch_ddp":
        runner = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = SGD(model.parameters())
    else:
        runner = build_engine(model, "fsdp", SGD, **MODES[mode])
    g = torch.Generator().manual_seed(1)
    n, gathers = BATCH_PER_RANK * env.world_size, []
    for step, micro_plans in enumerate(_plans(case, env.world_size)):
        for m, plans in enumerate(micro_plans):
            x, y = torch.randn(n, WIDTH, generator=g), torch.randn(n, OUT, generator=g)
            mine = slice(env.rank * BATCH_PER_RANK, (env.rank + 1) * BATCH_PER_RANK)
            with contextlib.nullcontext() if m else runner.no_sync():
                with comm.tracing() as trace:
                    out = runner(x[mine], plans[env.rank])
                if (step, m) == (1, 0):
                    gathers = [tag for ev, tag in trace if ev == "launch:all_gather"]
                nn.functional.mse_loss(out, y[mine]).backward()
        if mode == "torch_ddp":
            opt.step()
            opt.zero_grad()
        else:
            runner.step()
    if mode == "torch_ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = runner.full_state_dict()
    return {"state": state, "gathers": gathers}


# What `agreed_order` makes of each rank's first calls (units 0-6): name -> (rank r's
# calls, for r = 0, 1, ...: the first entry, or the r-th), the order every rank takes.
ORDERS = {
    # ALBERT's, unit 6 registered last, rank r skipping unit r
    "skips": (lambda r: (6, 0, 1, 2, 3, 4, 5)[: r + 1] + (6, 0, 1, 2, 3, 4, 5)[r + 2 :],
              [6, 0, 1, 2, 3, 4, 5]),
    # unit 3 skipped everywhere goes where it would run, unit 6 after its neighbour 5
    "skipped_everywhere": (lambda r: (5, 4, 2, 1, 0), [5, 6, 4, 3, 2, 1, 0]),
    # rank 0 calls 0 before 1, the others 1 before 0: registration order stays
    "conflict": (lambda r: (0, 1, 2) if r == 0 else (1, 0, 2), list(range(7))),
}  # fmt: skip


def _orders(env) -> dict[str, list[int]]:
    from trainer.parallel.schedule import agreed_order

    units = [object() for _ in range(7)]
    out = {}
    for name, (calls, _) in ORDERS.items():
        order = agreed_order(units, [id(units[i]) for i in calls(env.rank)])
        out[name] = [units.index(u) for u in order]
    return out


def _run(env) -> dict:
    out: dict = {"orders": _orders(env)}
    for case in CASES:
        for mode in ("torch_ddp", *MODES):
            out[case, mode] = _train(env, case, mode)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def trained(request):
    return request.param, run_distributed(_run, request.param, timeout=300, pg_timeout_s=20)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
def test_units_called_out_of_registration_order_train_as_torch_ddp(trained, case, mode):
    # SGD (no eps): the engines differ from torch DDP only in the order per-rank
    # gradients are summed (relative 1e-7), far below atol 1e-5 / rtol 1e-4 in 3 steps.
    _, results = trained
    for r, res in enumerate(results):
        try:
            assert_state_close(res[case, mode]["state"], res[case, "torch_ddp"]["state"])
        except AssertionError as e:
            raise AssertionError(f"rank {r}, {case}, {mode}: {e}") from None


def test_every_rank_takes_the_order_its_calls_and_its_peers_follow(trained):
    _, results = trained
    for r, res in enumerate(results):
        for name, (_, want) in ORDERS.items():
            assert res["orders"][name] == want, (r, name)


def test_a_later_forward_gathers_in_the_order_of_the_calls(trained):
    # Units 0-5 are the blocks and unit 6 `shared` (registration order; the root holds
    # `inp` and `head`). Called last to first, the second step's forward gathers the
    # blocks so, on the rank that skips block 2 too (the order is every rank's), with
    # `shared`, which no rank calls, after its registration neighbour (block 5). In
    # registration order the first call, of block 5, gathered all six blocks at once.
    _, results = trained
    want = ["root", "unit5", "unit6", "unit4", "unit3", "unit2", "unit1", "unit0"]
    for r, res in enumerate(results):
        assert res["reversed", "fsdp"]["gathers"] == want, r
