"""scripts/benchmarks/diloco_exact.py's harness, without its processes (the whole comparison,
eight of them, takes a minute or more on two shared cores: run the script): the batches it
hands torchft's groups are the trainer's, its comparison sees one ulp, and a schedule whose
last step is not a sync is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "scripts" / "benchmarks"


def test_the_batches_are_what_the_trainers_loader_hands_each_group():
    """Each group's batches of steps 1-3 against the DataLoader the trainer builds for that
    group's slot (g of 2), iterated as a run of one group would; the two groups' together
    are the global batch one process would take."""
    sys.path.insert(0, str(BENCHMARKS))
    import diloco_exact as dx
    from hydra.utils import instantiate

    from trainer.data.datasets import make_loader

    cfg = dx.compose(dx.trainer_args(12, 4, "sgd"))
    _, batches = dx.setup(cfg, 3)
    dataset = instantiate(cfg.data.dataset)
    for g in (0, 1):
        loader = iter(make_loader(dataset, cfg.train.batch_size, g, 2, cfg.seed))
        for step in range(3):
            x, y = next(loader)
            assert torch.equal(batches[g][step][0], x) and torch.equal(batches[g][step][1], y)
    whole = iter(make_loader(dataset, cfg.train.batch_size, 0, 1, cfg.seed))
    for step in range(3):
        x, _ = next(whole)
        assert torch.equal(torch.cat([batches[0][step][0], batches[1][step][0]]), x)


def test_the_comparison_sees_one_ulp_and_a_bad_schedule_is_refused(capsys):
    sys.path.insert(0, str(BENCHMARKS))
    import diloco_exact as dx

    a = {"w": torch.linspace(-2, 2, 101), "b": torch.ones(3)}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][7] = torch.nextafter(b["w"][7], torch.tensor(10.0))
    got = dx.compare(a, b)
    assert (got["tensors"], got["elements"], got["bitwise"]) == (2, 104, 1)
    ulp = (b["w"][7] - a["w"][7]).item()
    assert got["abs"] == ulp > 0 and got["rel"] == ulp / 2
    assert got["rel"] < dx.bound(12) == 2 * 12 * 256 * 2.0**-24
    assert dx.main(["--steps", "10", "--sync-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --steps=10 --sync-steps=4 --inner=sgd,adamw: needs H >= 1")
    assert err.count("\n") == 1
