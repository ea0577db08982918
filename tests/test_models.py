"""Model shapes, loss/metric, learnability on the embedded data, and the conf groups."""

from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from trainer.data.datasets import make_loader, synthetic_classification, synthetic_tokens
from trainer.errors import ConfigError
from trainer.models.build import model_sizes
from trainer.models.builtin import GPT, MLP, Block, SmallCNN, accuracy, loss_fn, resnet18

CONF = Path(__file__).resolve().parent.parent / "conf"


def test_mlp_shape_and_layers():
    model = MLP(in_dim=32, hidden=16, depth=3, num_classes=10)
    assert model(torch.randn(4, 32)).shape == (4, 10)
    # Every hidden Linear is its own submodule, so FSDP can wrap them one by one.
    assert len(model.layers) == 3
    assert all(isinstance(m, torch.nn.Linear) for m in model.layers)


@pytest.mark.parametrize("in_channels,size", [(3, 32), (1, 28)])
def test_small_cnn_shape_and_buffers(in_channels, size):
    model = SmallCNN(in_channels=in_channels, num_classes=7, width=8)
    assert model(torch.randn(2, in_channels, size, size)).shape == (2, 7)
    assert any("running_mean" in name for name, _ in model.named_buffers())


def test_resnet18_shape():
    model = resnet18(num_classes=5)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_gpt_shape_and_blocks():
    model = GPT(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=32)
    idx = torch.randint(50, (2, 16))
    assert model(idx).shape == (2, 16, 50)
    assert model(idx[:, :5]).shape == (2, 5, 50)
    assert len(model.blocks) == 3 and all(type(b) is Block for b in model.blocks)
    assert model.lm_head.weight is not model.wte.weight
    with pytest.raises(ConfigError, match="17.*block_size 16"):
        model(torch.randint(50, (1, 17)))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(vocab_size=20, block_size=8, n_embd=16).eval()
    idx = torch.randint(20, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 20
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])  # earlier positions cannot see position 5
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_gpt_tied_weights_share_one_tensor():
    tied = GPT(tie_weights=True)
    untied = GPT(tie_weights=False)
    assert tied.lm_head.weight is tied.wte.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == tied.wte.weight.numel()


def test_gpt_without_bias_is_nanogpts_architecture():
    # nanoGPT's defaults (bias=False, tied head) at its CPU shakespeare_char sizes: its
    # configure_optimizers reports 18 decayed tensors of 802,944 parameters and 9 others
    # (the LayerNorm gains) of 1,152.
    model = GPT(
        vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, tie_weights=True, bias=False
    )
    params = list(model.parameters())
    matrices = [p for p in params if p.ndim >= 2]
    gains = [p for p in params if p.ndim < 2]
    assert (len(matrices), sum(p.numel() for p in matrices)) == (18, 802_944)
    assert (len(gains), sum(p.numel() for p in gains)) == (9, 1_152)
    assert all(m.bias is None for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)))
    sizes = {k: v for k, v in model.model_config().items() if k != "model_type"}
    assert GPT(**sizes).model_config() == model.model_config()  # what config.json rebuilds
    assert model(torch.randint(65, (2, 64))).shape == (2, 64, 65)


def test_loss_and_accuracy_on_both_shapes():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])  # (B, C)
    targets = torch.tensor([0, 1, 1])  # (B,)
    expected = torch.nn.functional.cross_entropy(logits, targets)
    torch.testing.assert_close(loss_fn(logits, targets), expected)
    torch.testing.assert_close(accuracy(logits, targets), torch.tensor(2 / 3))

    seq_logits = torch.randn(2, 3, 5)  # (B, T, V)
    seq_targets = torch.randint(5, (2, 3))  # (B, T)
    expected = torch.nn.functional.cross_entropy(seq_logits.reshape(6, 5), seq_targets.reshape(6))
    torch.testing.assert_close(loss_fn(seq_logits, seq_targets), expected)
    # Predict the target everywhere except at two positions: 4 of 6 right.
    predicted = seq_targets.clone()
    predicted[0, 0] = (predicted[0, 0] + 1) % 5
    predicted[1, 2] = (predicted[1, 2] + 1) % 5
    seq_logits = torch.nn.functional.one_hot(predicted, 5).float()  # (B, T, V)
    torch.testing.assert_close(accuracy(seq_logits, seq_targets), torch.tensor(4 / 6))


def _train(model, dataset, steps: int, batch: int, lr: float) -> tuple[float, float]:
    """Mean loss of the first and last 5 steps."""
    # One process against no reference: nothing here compares two summation orders, so
    # AdamW's own default eps is what a user gets.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-8)
    batches = iter(make_loader(dataset, batch, rank=0, world_size=1, seed=0))
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


def test_mlp_learns_synthetic_classification():
    torch.manual_seed(0)
    model = MLP()
    first, last = _train(model, synthetic_classification(n=2048), steps=100, batch=64, lr=1e-3)
    assert first > 1.9 and last < 0.4, (first, last)
    held_out = synthetic_classification(n=1024, train=False)
    assert accuracy(model(held_out.tensors[0]), held_out.tensors[1]) > 0.85


def test_gpt_learns_synthetic_tokens():
    torch.manual_seed(0)
    model = GPT()
    first, last = _train(model, synthetic_tokens(n=1024), steps=60, batch=16, lr=3e-3)
    # ln 64 = 4.16 for a uniform guess; the bigram data's floor is ln 2 = 0.69.
    assert first > 3.0 and last < 1.5, (first, last)


# Each model group paired with a data group it is meant for; the pairings are the ones the
# yaml comments promise, so a change that breaks one shows here.
PAIRS = [("mlp", "synthetic"), ("gpt", "tokens"), ("cnn", "images"), ("resnet18", "images")]


@pytest.mark.parametrize("model_name,data_name", PAIRS)
def test_conf_groups_instantiate_and_fit_together(model_name, data_name):
    cfg = OmegaConf.create(
        {
            "model": OmegaConf.load(CONF / "model" / f"{model_name}.yaml"),
            "data": OmegaConf.load(CONF / "data" / f"{data_name}.yaml"),
        }
    )
    cfg.data.dataset.n = 8  # keep it quick; the other arguments stay as configured
    dataset = instantiate(cfg.data.dataset)
    model = instantiate(cfg.model, **model_sizes(cfg, dataset))
    x, y = next(iter(make_loader(dataset, 4, rank=0, world_size=1, seed=0)))
    loss = loss_fn(model(x), y)
    assert torch.isfinite(loss)


def test_torchvision_data_confs_read_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDTRAIN_DATA", str(tmp_path))
    for name in ("mnist", "cifar10"):
        cfg = OmegaConf.create({"data": OmegaConf.load(CONF / "data" / f"{name}.yaml")})
        assert cfg.data.dataset.root == str(tmp_path)
        assert cfg.data.dataset.download is False
        # Hydra wraps errors raised by a target in InstantiationException; the trainer
        # unwraps __cause__ to print the ConfigError's one line.
        with pytest.raises(InstantiationException) as info:
            instantiate(cfg.data.dataset)
        assert isinstance(info.value.__cause__, ConfigError)
        assert "data.download=true" in str(info.value.__cause__)


# ---------------------------------------------------------------------------------------
# What a model adds to a step ([Note: model hooks] in trainer/models/hooks.py)


def test_the_loop_imports_no_model_family():
    """trainer/run/loop.py imports nothing of trainer.models.builtin and names none of
    GPT-MoE's own functions or figures: what a model adds comes through its hooks."""
    import ast

    import trainer.run.loop as loop

    tree = ast.parse(Path(loop.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("trainer.models.builtin") for m in modules), modules
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    moe = {"aux_loss", "update_expert_bias", "expert_loads", "moe_figures", "GPTMoE", "MoE"}
    assert not names & moe, names & moe
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert not [t for t in texts if isinstance(t, str) and t.startswith("moe/")]


def test_model_hooks_are_looked_up_on_the_class():
    """A submodule or tensor named like a hook is not one; a model without hooks gets
    ones that do nothing."""
    from trainer.models.hooks import model_hooks

    model = nn.Module()
    model.after_step = nn.Linear(1, 1)  # a submodule that happens to share the name
    model.extra_loss = torch.ones(())
    hooks = model_hooks(model)
    assert hooks.extra_loss() is None and hooks.figures() == {}
    hooks.after_step(True)
    assert hooks.figures_to_log({"a": 1.0}) == {"a": 1.0}


# Tiny transformers MoE causal LMs, each keeping its router-loss coefficient elsewhere:
# Mixtral and Qwen2-MoE in the config and on the model (router_aux_loss_coef), JetMoe as
# the model's and the config's aux_loss_coef.
HF_MOE = {
    "mixtral": dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
    ),
    "qwen2_moe": dict(
        hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
    ),
    "jetmoe": dict(
        hidden_size=16, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, aux_loss_coef=0.03,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(HF_MOE))
def test_hf_moe_trains_the_loss_hf_computes_with_labels(model_type):
    """model=hf MoE with output_router_logits: the loss the loop trains (cross entropy
    plus the model's extra loss) is the one transformers returns given labels, router
    loss times the model's own coefficient included, with its gradients."""
    from trainer.models.hooks import model_hooks
    from trainer.models.lm import hf_causal_lm

    config = {**HF_MOE[model_type], "model_type": model_type, "vocab_size": 32}
    config.update(max_position_embeddings=16, output_router_logits=True)
    torch.manual_seed(0)
    model = hf_causal_lm(config=config)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    # HF predicts labels[:, 1:] from the logits before them; the loop's targets are the
    # next tokens, the last position left out (-100, as HF pads its shifted labels)
    y = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    extra = model_hooks(model).extra_loss
    ours = loss_fn(model(x), y) + extra()
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want = model.hf(input_ids=x, labels=x, use_cache=False)
    assert want.aux_loss is not None and extra() is not None
    want.loss.backward()
    # The same operations but for HF's cross entropy (a sum over the targets, divided by
    # their count, where loss_fn takes the mean): a few fp32 roundings of numbers about 3.
    torch.testing.assert_close(ours, want.loss, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours_grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_hf_moe_router_loss_without_a_coefficient_is_refused():
    from trainer.models.lm import hf_causal_lm

    config = {**HF_MOE["mixtral"], "model_type": "mixtral", "vocab_size": 32}
    model = hf_causal_lm(config={**config, "output_router_logits": True})
    model.router_loss_coef = None  # as for a model keeping it under another name
    with pytest.raises(ConfigError, match="mixtral: its forward returns a router loss"):
        model(torch.zeros(1, 4, dtype=torch.long))
