"""Checkpoints that cannot lose a run: the completion marker, pruning killed halfway, a
full disk, a hostile pickle, the optimizer values of the command line on resume."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_cli
from test_cli import ROOT, run_cli

TINY = ["model.hidden=16", "model.depth=1", "train.batch_size=16", "train.log_every=1"]


def _error_lines(proc) -> list[str]:
    return [x for x in proc.stderr.replace("\r", "\n").splitlines() if "error:" in x]


# ---------------------------------------------------------------------------------------
# Item: a checkpoint is complete only by its marker; pruning leaves no partial one


def test_a_directory_without_the_marker_is_not_a_checkpoint(tmp_path):
    from trainer.checkpoint import find_checkpoints

    for step in (1, 2):
        d = tmp_path / f"step_00000{step}"
        d.mkdir()
        (d / "meta.pt").write_bytes(b"x")
        (d / "rank0.pt").write_bytes(b"x")
    (tmp_path / "step_000001" / "COMPLETE").write_text(json.dumps({"step": 1}))
    assert find_checkpoints(tmp_path) == [tmp_path / "step_000001"]


def test_killed_while_pruning_leaves_no_partial_checkpoint(tmp_path):
    from trainer.checkpoint import find_checkpoints

    run_dir = tmp_path / "run"
    args = [*TINY, f"hydra.run.dir={run_dir}", "ckpt.every=1", "ckpt.keep=1"]
    killed = warm_cli.command(
        [sys.executable, str(ROOT / "train.py"), *args, "train.steps=3"],
        {"SHARDTRAIN_FAULT": "0:2:kill_in_prune"},
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL while removing step 1
    ckpts = run_dir / "checkpoints"
    # Step 1 lost a file, but under a name that is not a checkpoint's.
    assert not (ckpts / "step_000001").exists()
    assert [p.name for p in find_checkpoints(ckpts)] == ["step_000002"]
    proc = run_cli([*args, "train.steps=3", "resume=auto"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {ckpts / 'step_000002'} at step 2" in proc.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["lineage", "step_000003"]


# ---------------------------------------------------------------------------------------
# Item: a hostile file is refused for what it is, and nothing in it runs


class _RunsCode:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_pickle_that_would_run_code_is_named_as_such(tmp_path):
    flag = tmp_path / "it_ran"
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    torch.save({"format": 1, "step": 1, "evil": _RunsCode(flag)}, ckpt / "meta.pt")
    proc = warm_cli.command(
        [sys.executable, str(ROOT / "scripts" / "consolidate.py"), str(ckpt), str(tmp_path / "o")]
    )
    assert proc.returncode == 2
    [line] = _error_lines(proc)
    assert line == (
        f"error: {ckpt / 'meta.pt'} holds objects other than tensors and plain values; it was "
        "not loaded, for safety (unpickling it could run code)"
    )
    assert "weights_only" not in proc.stderr
    assert not flag.exists()


# ---------------------------------------------------------------------------------------
# Item: a full disk is named, and leaves nothing behind


def _disk_full_after(monkeypatch, limit: int) -> None:
    """Writes through torch.save fail as on a full disk after `limit` bytes."""
    from trainer.checkpoint import files

    written = [0]
    original = files.Sink.write

    def write(self, data):
        written[0] += len(data)
        if written[0] > limit:
            self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise self.error
        return original(self, data)

    monkeypatch.setattr(files.Sink, "write", write)


def test_full_disk_writing_a_file(tmp_path, monkeypatch):
    from trainer.checkpoint import write_file
    from trainer.errors import TrainingError

    _disk_full_after(monkeypatch, 1000)
    path = tmp_path / "final_model.pt"
    with pytest.raises(TrainingError) as e:
        write_file(path, {"w": torch.zeros(2**18)})  # 1 MB of fp32
    assert str(e.value).startswith(f"no space left on device writing {path} (it needs about 1.0")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .tmp


def test_full_disk_saving_the_final_model(tmp_path, monkeypatch):
    from trainer.errors import TrainingError
    from trainer.run.final import save_final_model

    class Engine:
        def full_state_dict(self, rank0_only: bool = False):
            return {"w": torch.ones(4096)}

    _disk_full_after(monkeypatch, 100)
    with pytest.raises(TrainingError, match="no space left on device writing .*final_model.pt"):
        save_final_model(Engine(), tmp_path / "final_model.pt", is_rank0=True)
    assert list(tmp_path.iterdir()) == []


def _save_on_a_full_disk(env, directory: Path):
    from torch import nn

    from trainer import checkpoint
    from trainer.errors import TrainingError
    from trainer.parallel import build_engine

    class Patch:  # monkeypatch is not picklable into the worker
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    _disk_full_after(Patch(), 2000)
    engine = build_engine(nn.Linear(64, 64), "ddp", functools.partial(torch.optim.SGD, lr=0.1))
    try:
        checkpoint.save(directory, 5, engine)
    except TrainingError as e:
        return str(e)
    return None


def test_full_disk_during_a_checkpoint(tmp_path):
    from dist_harness import run_distributed

    [message] = run_distributed(_save_on_a_full_disk, 1, tmp_path)
    assert message.startswith(
        f"rank 0 could not write its part of checkpoint {tmp_path / 'step_000005'}: "
        "no space left on device writing"
    ), message
    assert list(tmp_path.iterdir()) == []  # the temporary directory went too


def test_unwritable_ckpt_dir_is_found_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    proc = run_cli(
        [*TINY, f"run.root={tmp_path}", f"ckpt.dir={blocker / 'ckpt'}", "train.steps=500"],
        nproc=None,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = _error_lines(proc)
    assert line == f"error: ckpt.dir {blocker / 'ckpt'} is not writable: Not a directory"
    assert "1/500" not in proc.stderr  # refused before the first step


def _consolidate(capsys, *args: str) -> tuple[int, list[str]]:
    """scripts/consolidate.py in this process: its exit code and stderr lines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "consolidate", ROOT / "scripts" / "consolidate.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main([str(a) for a in args])
    return code, capsys.readouterr().err.splitlines()


def test_consolidate_refuses_an_unwritable_output_and_another_model(tmp_path, capsys):
    from trainer import checkpoint  # noqa: F401  (the import path the script uses)

    run_dir = tmp_path / "run"
    proc = run_cli([*TINY, f"hydra.run.dir={run_dir}", "train.steps=2"], nproc=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = warm_cli.command(
        [
            sys.executable,
            str(ROOT / "scripts" / "consolidate.py"),
            str(run_dir / "checkpoints"),
            str(blocker / "model.pt"),
        ]
    )
    assert out.returncode == 2
    [line] = _error_lines(out)
    assert line == f"error: cannot write {blocker / 'model.pt'}: Not a directory"
    assert "Traceback" not in out.stderr

    ckpts, model_pt = run_dir / "checkpoints", tmp_path / "model.pt"
    # The run directory's newest run used another model (here: a wider MLP; as when a
    # later run in the same directory was refused its checkpoints but left its config).
    run_config = run_dir / ".hydra" / "config.yaml"
    text = run_config.read_text()
    assert "hidden: 16" in text
    run_config.write_text(text.replace("hidden: 16", "hidden: 32"))
    code, err = _consolidate(capsys, ckpts, model_pt)
    assert code == 2 and err == [
        f"error: checkpoint {ckpts / 'step_000002'} holds another model than the newest run "
        f"in {run_dir} used: model.hidden=16 (that run: 32); consolidate a checkpoint of that "
        "run, or pass --any-model to write this one anyway"
    ]
    assert not model_pt.exists()
    code, err = _consolidate(capsys, ckpts, model_pt, "--any-model")
    assert code == 0 and err == []
    assert torch.load(model_pt, weights_only=True)["layers.0.weight"].shape == (16, 32)
    # The same model: written. activation_checkpointing does not change the weights.
    assert "activation_checkpointing: false" in text
    run_config.write_text(
        text.replace("activation_checkpointing: false", "activation_checkpointing: true")
    )
    assert _consolidate(capsys, ckpts, tmp_path / "again.pt") == (0, [])
    # An output that is a directory: one line.
    code, err = _consolidate(capsys, ckpts, tmp_path)
    assert code == 2 and err == [f"error: {tmp_path} is a directory; give the file to write (.pt)"]


def test_a_repeated_warning_is_printed_once(capsys, monkeypatch):
    # A checkpoint skipped again (a later load, a restart's retry) is not warned about twice.
    from trainer import comm
    from trainer.checkpoint import agree

    monkeypatch.setattr(comm, "rank", lambda group=None: 0)
    monkeypatch.setattr(agree, "said", set())
    for _ in range(3):
        agree.say("warning: skipping checkpoint a: truncated")
    agree.say("warning: skipping checkpoint b: truncated")
    assert capsys.readouterr().out.splitlines() == [
        "warning: skipping checkpoint a: truncated",
        "warning: skipping checkpoint b: truncated",
    ]


# ---------------------------------------------------------------------------------------
# Item: a schedule of faults ([Note: fault injection]): each entry once, bad ones named


def test_a_fault_schedule_fires_each_entry_once_in_order_of_reaching_it(tmp_path, monkeypatch):
    from trainer.checkpoint import faults

    monkeypatch.setattr(faults.comm, "rank", lambda: 1)
    monkeypatch.setenv(faults.FAULT_ENV, "1:2:fail_in_save,0:2:fail_in_save,1:4:fail_in_save")
    once = tmp_path / "fired"
    monkeypatch.setenv(faults.FAULT_ONCE_ENV, str(once))

    def fires(where: str, step: int) -> bool:
        try:
            faults.fault(where, step)
        except OSError:
            return True
        return False

    assert not fires("step", 2)  # another point of the same step
    assert fires("save", 2) and not fires("save", 2)  # once: a restarted group passes it
    assert not fires("save", 3) and fires("save", 4) and not fires("save", 4)
    assert sorted(p.name for p in once.iterdir()) == ["0-1-2-fail_in_save", "2-1-4-fail_in_save"]
    # Without SHARDTRAIN_FAULT_ONCE an entry fires every time; with the older form (a file
    # that exists: fired already) nothing does.
    monkeypatch.delenv(faults.FAULT_ONCE_ENV)
    assert fires("save", 2) and fires("save", 2)
    (tmp_path / "marker").touch()
    monkeypatch.setenv(faults.FAULT_ONCE_ENV, str(tmp_path / "marker"))
    assert not fires("save", 4)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1:5", "entry '1:5' is not RANK:STEP:ACTION with RANK >= 0, STEP >= 1 and ACTION one of"),
        ("1:5:kill,1:five:kill", "entry '1:five:kill' is not RANK:STEP:ACTION"),
        ("1:0:kill", "entry '1:0:kill' is not RANK:STEP:ACTION"),
        ("0:3:explode", "kill, hang, term, corrupt, kill_in_save, fail_in_save, kill_in_prune"),
        ("1:4:kill_in_prune", "can never fire: rank 0 alone prunes checkpoints"),
        ("0:2:kill,2:3:term", "entry 2:3:term names rank 2, but this run has ranks 0..1"),
    ],
)
def test_a_bad_fault_schedule_is_refused_in_one_line(monkeypatch, spec, message):
    from trainer.checkpoint import faults
    from trainer.errors import ConfigError

    monkeypatch.setenv(faults.FAULT_ENV, spec)
    with pytest.raises(ConfigError) as e:
        faults.check(world_size=2)
    assert str(e.value).startswith(f"SHARDTRAIN_FAULT={spec!r}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def _chaos():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_chaos_fails_on_any_run_that_did_not_end_bitwise_equal(tmp_path, monkeypatch, capsys):
    # The soak's table and exit code, with torchrun and the comparison faked: a NO row fails it.
    chaos = _chaos()

    def launch(args, world, env, restarts, log):
        run_dir = Path(next(a for a in args if a.startswith("hydra.run.dir="))[14:])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "final_model.pt").touch()
        return 1.0, 0, []

    ends = {}
    monkeypatch.setattr(chaos, "launch", launch)
    monkeypatch.setattr(chaos, "same_end", lambda run, clean: ends.get(run.name, (True, True)))
    argv = ["--faults", "2", "--modes", "fsdp", "--worlds", "2", "--out", str(tmp_path)]
    assert chaos.main(argv) == 0
    assert "| NO |" not in capsys.readouterr().out
    ends["fsdp_p2_async"] = (False, True)
    assert chaos.main(argv) == 1
    out, err = capsys.readouterr()
    assert "| fsdp | 2 | on | 0 of 1 |" in out and "| NO | yes |" in out
    assert err.splitlines() == [
        "error: fsdp_p2_async: final model + last checkpoint not bitwise equal "
        f"(log: {tmp_path / 'fsdp_p2_async'}.log)"
    ]
    ends["fsdp_p2_sync"] = (True, False)
    assert chaos.main(argv) == 1
    assert "fsdp_p2_sync: tokens seen not bitwise equal" in capsys.readouterr().err
