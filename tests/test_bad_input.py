"""Every row of the bad-input table (docs/bad_input.md): exit code and the one-line message."""

from __future__ import annotations

import pytest
from test_cli import run_cli

CASES = [
    # (overrides, ranks (None: plain python), exit code, text the one error line holds)
    (["mode=foo"], None, 2, "mode=foo is not one of ddp"),
    (
        ["model=nope"],
        None,
        2,
        "model=nope is not one of cnn, gpt, gpt_moe, hf, mlp, nanogpt, resnet18",
    ),
    (["data=imagenet"], None, 2, "data=imagenet is not one of"),
    (["optim=lion"], None, 2, "optim=lion is not one of adamw, sgd"),
    (["-m", "mode=ddp,bogus"], None, 2, "mode=bogus is not one of"),
    (["train.batch_size=7"], 2, 2, "train.batch_size=7 is not divisible by world size 2"),
    (
        ["train.batch_size=12", "train.grad_accum_steps=4"],
        2,
        2,
        "train.batch_size=12 is not divisible by world size 2 x train.grad_accum_steps=4",
    ),
    (["optim.schedule=linear"], None, 2, "optim.schedule='linear' is not one of constant"),
    (["train.steps=0"], None, 2, "train.steps=0 must be a positive number"),
    (["train.batch_size=-8"], None, 2, "train.batch_size=-8 must be a positive number"),
    (["optim.lr=-1"], None, 2, "optim.lr=-1 must be a positive number"),
    (["optim.lr=0"], None, 2, "optim.lr=0 must be a positive number"),
    (["mode.bucket_mb=0"], None, 2, "mode.bucket_mb=0 must be a positive number"),
    (["dist.backend=nccl"], None, 2, "dist.backend=nccl needs a CUDA GPU"),
    (["dist.backend=mpi"], None, 2, "dist.backend='mpi' is not one of auto, gloo, nccl"),
    (["optim=sgd", "optim.lr=1e20"], None, 1, "loss is not finite at step"),
    (["precision=fp8"], None, 2, "precision='fp8' is not one of fp32, bf16, fp16"),
    (["mode.reduce_dtype=int4"], 2, 2, "mode.reduce_dtype='int4' is not one of fp32, bf16"),
    (["mode=zero", "mode.gather_dtype=fp8"], None, 2, "mode.gather_dtype='fp8' is not one of null"),
    (["mode.quant_block=6"], None, 2, "mode.quant_block=6 must be a multiple of 4"),
    (["mode.error_feedback=true"], None, 2, "mode.error_feedback=true feeds back int8 rounding"),
    (["mode.gather_dtype=int8"], None, 2, "Could not override 'mode.gather_dtype'"),
    (["comm.link_gbps=0"], None, 2, "comm.link_gbps=0 must be a positive number"),
    (["mode.offload=disk"], None, 2, "mode.offload=disk applies to zero and fsdp: ddp replicates"),
    (["mode=zero", "mode.offload=host"], None, 2, "mode.offload=host moves state from the GPU"),
    (["mode=fsdp", "mode.offload=nvme"], None, 2, "mode.offload='nvme' is not one of null, host"),
    (["mode=zero", "mode.offload=disk", "ckpt.async=true"], None, 2, "ckpt.async=true with mode"),
    (["precision=fp16", "loss_scale.init_scale=0"], None, 2, "loss_scale.init_scale=0 must"),
    (["mode=fsdp", "mode.foo=1"], 2, 2, "Could not override 'mode.foo'"),
    (["mode=zero", "mode.shard_group_size=3"], 2, 2, "mode.shard_group_size=3 must divide"),
    (["optim.lr=nan"], None, 2, "optim.lr=nan must be a positive number"),
    (["optim.weight_decay=-1"], None, 2, "optim.weight_decay=-1 must be a number >= 0"),
    (["train.steps=1.5"], None, 2, "train.steps=1.5: Value '1.5' of type 'float' could not be"),
    (["train.steps=1e2"], None, 2, "train.steps=1e2: Value '100.0' of type 'float' could not"),
    (["seed=abc"], None, 2, "seed=abc: Value 'abc' of type 'str' could not be converted"),
    (["seed=1e30"], None, 2, "seed=1e30: Value '1e+30' of type 'float' could not be"),
    (["seed=-1"], None, 2, "seed=-1 must be a whole number from 0 to 4294967295"),
    (["mode.bucket_mb=abc"], None, 2, "mode.bucket_mb=abc: Value 'abc' of type 'str' could"),
    (["-m", "mode=ddp,zero", "optim.lr=x"], None, 2, "optim.lr=x: Value 'x' of type 'str'"),
    (["dist.timeout_s=-1"], None, 2, "dist.timeout_s=-1 must be a positive number"),
    (["dist.timeout_s=0"], None, 2, "dist.timeout_s=0 must be a positive number"),
    (["model.hidden=0"], None, 2, "model.hidden=0 must be a whole number >= 1"),
    (["model=cnn", "data=images", "model.width=0"], None, 2, "model.width=0 must be a whole"),
    (["mode=fsdp", "mode.min_unit_params=-1"], None, 2, "mode.min_unit_params=-1 must be"),
    (["launcher.nproc=0"], None, 2, "launcher.nproc=0 must be a whole number >= 1"),
    (["hydra.run.dir=/proc/x"], None, 2, "run directory /proc/x cannot be created"),
    (["model.num_classes=5"], None, 2, "model=mlp does not fit data=synthetic: targets go up"),
    (["model=gpt"], None, 2, "model=gpt does not fit data=synthetic"),
    (["train.steps=${oc.env:NOPE}"], None, 2, "Environment variable 'NOPE' not found"),
    # ft ([Note: fault-tolerant replica groups] in trainer/comm/replicas.py)
    (
        ["ft.enabled=true", "ft.replica_groups=2", "ft.replica_group=2"],
        None,
        2,
        "ft.replica_group=2 must be one of 0..1 (ft.replica_groups=2)",
    ),
    (
        ["ft.enabled=true", "ft.replica_groups=2", "ft.min_groups=3"],
        None,
        2,
        "ft.min_groups=3 is more than ft.replica_groups=2",
    ),
    (
        ["ft.enabled=true", "ft.replica_groups=3", "train.batch_size=64"],
        2,
        2,
        "train.batch_size=64 is not divisible by world size 2 x ft.replica_groups=3",
    ),
    (["ft.enabled=true", "ft.stall_timeout_s=0"], None, 2, "ft.stall_timeout_s=0 must be a pos"),
    (
        ["ft.enabled=true", "mode=zero", "mode.offload=disk"],
        None,
        2,
        "ft.enabled=true with mode.offload=disk: a replica group heals from",
    ),
    (
        ["ft.enabled=true", "model=gpt_moe", "data=tokens", "model.bias_update_speed=0.001"],
        None,
        2,
        "ft.enabled=true with model.bias_update_speed=0.001: the routing bias",
    ),
    (["ft.enabled=true", "ft.lighthouse=null"], None, 2, "ft.enabled=true needs a Lighthouse"),
    (
        ["ft.replica_groups=2", "ft.replica_group=1"],
        None,
        2,
        "ft.replica_group=1 and ft.replica_groups=2 have no effect without ft.enabled=true",
    ),
]


@pytest.mark.parametrize("args, ranks, code, needle", CASES, ids=lambda v: str(v))
def test_bad_input_gets_one_line(tmp_path, args, ranks, code, needle):
    # Several ranks go through launcher.nproc: torchrun would add its own failure report.
    extra = [f"launcher.nproc={ranks}"] if ranks else []
    if not any(a.startswith("train.steps=") for a in args):
        extra.append("train.steps=5")
    proc = run_cli([*args, *extra, f"run.root={tmp_path}"], nproc=None)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_dataset_missing_with_download_off(tmp_path):
    proc = run_cli(
        [
            "model=cnn",
            "data=cifar10",
            f"data.root={tmp_path / 'none'}",
            f"run.root={tmp_path}",
            "train.steps=2",
        ],
        nproc=None,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert str(tmp_path / "none") in line and "data.download=true" in line


def test_run_dir_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    proc = run_cli([f"run.root={blocker / 'runs'}", "train.steps=2"], nproc=None)
    assert proc.returncode == 2
    [line] = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert "is not a writable directory" in line and str(blocker) in line
    assert blocker.read_text() == "keep me"  # nothing written over


def test_nonfinite_loss_can_be_skipped(tmp_path):
    proc = run_cli(
        [
            "optim=sgd",
            "optim.lr=1e20",
            "train.on_nonfinite=skip",
            f"run.root={tmp_path}",
            "train.steps=6",
        ],
        nproc=None,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _tiny_model_sharded(env, mode):
    from torch import nn

    from trainer.errors import ConfigError
    from trainer.parallel import build_engine

    try:
        build_engine(nn.Linear(1, 1, bias=False), mode, optimizer=lambda ps: None)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_more_ranks_than_parameters_to_shard(mode):
    from dist_harness import run_distributed

    msgs = run_distributed(_tiny_model_sharded, 2, mode)
    assert all(m and "the model has 1 parameter(s), fewer than the 2 ranks" in m for m in msgs)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["mode=fsdp", "mode.reshard_after_forward=maybe"], "Value 'maybe' is not a valid bool"),
        (["mode=fsdp", "mode.min_unit_params=1.5"], "Value '1.5' of type 'float' could not"),
        (["mode=zero", "mode.shard_group_size=two"], "Value 'two' of type 'str' could not"),
        (["mode=ddp", "mode.shard_group_size=2"], "Key 'shard_group_size' not in 'DdpMode'"),
        (["optim=sgd", "optim.momentum=high"], "Value 'high' of type 'str' could not"),
        (["optim.betas=[0.9,x]"], "Value 'x' of type 'str' could not be converted to Float"),
    ],
)
def test_every_mode_and_optim_key_is_typed(overrides, reason):
    # Composed here (the command line gives these the one line of the table's type row).
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from test_cli import ROOT

    from trainer.config import schema  # noqa: F401  (registers the types)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as e:
            compose("config", overrides=overrides)
        assert reason in str(e.value.__cause__)


def test_each_mode_and_optim_choice_composes_with_its_schema():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from test_cli import ROOT

    from trainer.config import schema
    from trainer.errors import ConfigError
    from trainer.run.optim import optimizer_factory

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for group, choice, node in [
            ("mode", "ddp", schema.DdpMode),
            ("mode", "zero", schema.ZeroMode),
            ("mode", "fsdp", schema.FsdpMode),
            ("optim", "adamw", schema.AdamWOptim),
            ("optim", "sgd", schema.SGDOptim),
        ]:
            cfg = compose("config", overrides=[f"{group}={choice}"])
            assert OmegaConf.get_type(cfg[group]) is node, (group, choice)
            if group == "optim":
                # A null argument is not passed (fp16 may then build the optimizer
                # fused); one given is. adamw is fused unless told otherwise.
                given = {"fused", "foreach"} & optimizer_factory(cfg.optim).keywords.keys()
                assert given == ({"fused"} if choice == "adamw" else set())
                foreach = [f"optim={choice}", "optim.foreach=true", "optim.fused=null"]
                cfg = compose("config", overrides=foreach)
                assert optimizer_factory(cfg.optim).keywords["foreach"] is True
                assert "fused" not in optimizer_factory(cfg.optim).keywords
                cfg = compose("config", overrides=[f"optim={choice}", "optim.foreach=true"])
                if choice == "adamw":  # both: one line, not torch's traceback at the build
                    with pytest.raises(ConfigError, match="optim.fused=null to use foreach"):
                        optimizer_factory(cfg.optim)


@pytest.mark.parametrize(
    "meta, tokenizer, ranks, needle",
    [
        ("{bad", None, None, "meta.json is not JSON (Expecting property name enclosed in double"),
        ('{"tokenizer": "hf"}', '{"x":', 2, "tokenizer.json is not a tokenizer the tokenizers"),
    ],
    ids=["meta_not_json", "tokenizer_json"],
)
def test_bad_token_directory_gets_one_line(tmp_path, meta, tokenizer, ranks, needle):
    import numpy as np

    data = tmp_path / "tokens"
    data.mkdir()
    (np.arange(4000) % 20).astype(np.uint16).tofile(data / "train.bin")
    (data / "meta.json").write_text(meta)
    if tokenizer is not None:
        (data / "tokenizer.json").write_text(tokenizer)
    extra = [f"launcher.nproc={ranks}", "train.batch_size=4"] if ranks else []
    args = ["model=gpt", "data=token_file", f"data.dir={data}", "train.eval_every=0"]
    proc = run_cli([*args, *extra, "train.steps=2", f"run.root={tmp_path}"], nproc=None)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    # one line, on every rank alike: no other rank reports a peer that went away
    assert len(lines) == 1 and needle in lines[0] and str(data) in lines[0], proc.stderr[-2000:]


# [Note: ft keys without ft.enabled] in trainer/config/checks.py, checked on the composed
# config (the table's row above goes through the command line once).
FT_OFF = (
    "has no effect without ft.enabled=true: set ft.enabled=true to join replica groups, or drop it"
)


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir
    from test_cli import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, shown",
    [
        ("ft.replica_groups=2", "ft.replica_groups=2"),  # int
        ("ft.lighthouse=http://10.0.0.7:29510", "ft.lighthouse=http://10.0.0.7:29510"),  # str
        ("ft.quorum_timeout_s=7.5", "ft.quorum_timeout_s=7.5"),  # float
        ("ft.stall_timeout_s=600", "ft.stall_timeout_s=600"),  # float, typed as a whole number
    ],
)
def test_an_ft_key_without_ft_enabled_is_refused(override, shown):
    from trainer.config.checks import validate
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(_composed(override), 1)
    assert str(e.value) == f"{shown} {FT_OFF}"
    # with ft.enabled=true the same key is what it is for
    lighthouse = [] if "lighthouse" in override else ["ft.lighthouse=http://10.0.0.7:29510"]
    validate(_composed("ft.enabled=true", override, *lighthouse), 1)


def test_ft_defaults_pass_without_ft_enabled(monkeypatch):
    from trainer.config.checks import validate

    validate(_composed(), 1)
    validate(_composed("ft.enabled=false", "ft.timeout_s=30", "ft.lighthouse=null"), 1)
    # an exported TORCHFT_LIGHTHOUSE reaches ft.lighthouse through conf/config.yaml: not
    # the user setting the key
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.7:29510")
    cfg = _composed()
    assert cfg.ft.lighthouse == "http://10.0.0.7:29510"
    validate(cfg, 1)


def test_an_ft_key_added_to_the_schema_later_is_covered(monkeypatch):
    """A key the schema gains (here a bool) is held to its default without ft, with no
    list of keys to update."""
    import dataclasses

    from omegaconf import OmegaConf

    from trainer.config import schema
    from trainer.config.checks import validate
    from trainer.errors import ConfigError

    @dataclasses.dataclass
    class LaterFt(schema.Ft):
        spare_option: bool = False

    monkeypatch.setattr(schema, "Ft", LaterFt)
    base = _composed()
    validate(OmegaConf.merge(base, {"ft": OmegaConf.structured(LaterFt())}), 1)
    on = OmegaConf.merge(base, {"ft": OmegaConf.structured(LaterFt(spare_option=True))})
    with pytest.raises(ConfigError) as e:
        validate(on, 1)
    assert str(e.value) == f"ft.spare_option=true {FT_OFF}"
