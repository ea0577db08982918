"""fp16 needs engine.backward(loss), which scales the loss; a plain loss.backward() is
refused at its first gradient hook, before any collective, and the engine trains on."""

import functools

import pytest
import torch
from dist_harness import run_distributed
from reference import any_loss, batches, make_model, rank_slice

MODES = {"ddp": {}, "zero": {}, "fsdp": {"min_unit_params": 50, "unit_classes": []}}


def _plain_then_scaled(env) -> dict:
    from trainer import comm
    from trainer.errors import ConfigError
    from trainer.parallel import build_engine

    out = {}
    for mode, options in MODES.items():
        engine = build_engine(
            make_model("mlp", seed=0),
            mode,
            functools.partial(torch.optim.SGD, lr=0.1),
            precision="fp16",
            **options,
        )
        (x, y), (x2, y2) = batches("mlp", 2, 8)
        x, y = rank_slice(x, env.rank, 2), rank_slice(y, env.rank, 2)
        loss = any_loss(engine(x), y)
        with comm.tracing() as events:
            try:
                loss.backward()
                error = ""
            except ConfigError as e:
                error = str(e)
        launched = [e for e in events if e[0].startswith("launch:")]
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        # The engine is usable afterwards: a scaled backward and a step train.
        x2, y2 = rank_slice(x2, env.rank, 2), rank_slice(y2, env.rank, 2)
        engine.backward(any_loss(engine(x2), y2))
        stepped = engine.step()
        after = engine.full_state_dict()
        moved = max((after[k] - before[k]).abs().max().item() for k in before)
        out[mode] = (error, launched, stepped, moved)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_plain_then_scaled, 2)


@pytest.mark.parametrize("mode", MODES)
def test_plain_backward_in_fp16_is_refused_before_any_collective(results, mode):
    for rank_results in results:
        error, launched, stepped, moved = rank_results[mode]
        assert error.startswith("precision=fp16 needs engine.backward(loss)"), error
        assert launched == []  # refused at the first hook: nothing was communicated
        assert stepped and moved > 0  # and a scaled backward then trains as usual
