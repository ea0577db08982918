"""The training loop. It talks to the engine interface only and never branches on the mode
or the model family: what a model adds to a step comes through its hooks
([Note: model hooks] in trainer/models/hooks.py)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from trainer import checkpoint, comm
from trainer.checkpoint import faults
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.comm.diloco import fragments_for, join_groups
from trainer.comm.replicas import Replicas, TooFewGroups
from trainer.config.checks import engine_options, validate
from trainer.data.datasets import LoaderBatches, SlotBatches, make_eval_loader, make_loader
from trainer.data.text import codec_from_meta
from trainer.data.tokens import read_meta
from trainer.errors import ConfigError, TrainingError
from trainer.models.build import data_dir, model_and_data
from trainer.models.compile import compile_layers
from trainer.models.hooks import ModelHooks, model_hooks
from trainer.models.lm import generate, positions, save_model_files
from trainer.models.loss import accuracy, loss_fn
from trainer.models.materialize import SeededInit, empty_weights
from trainer.models.weights import Pretrained
from trainer.observe import heap
from trainer.observe.memory import MemoryMonitor, count_params
from trainer.observe.metrics import IntervalMetrics, Rank0Writer, evaluate, peak_flops
from trainer.parallel import build_engine, experts, state
from trainer.parallel.engine import Engine
from trainer.run import dist as tdist
from trainer.run import preempt, rundir
from trainer.run.final import final_model_path, save_final_model
from trainer.run.fit import check_fit
from trainer.run.guard import Guard
from trainer.run.optim import lr_scheduler, optimizer_factory, param_options
from trainer.run.profiling import maybe_profile


def shared_run_dir(env: tdist.DistEnv) -> Path:
    """Rank 0's Hydra output directory, handed to every rank (see train.py)."""
    obj = [HydraConfig.get().runtime.output_dir if env.is_rank0 else None]
    comm.broadcast_object(obj)
    return Path(obj[0])


def train(cfg: DictConfig) -> dict[str, Any]:
    preempt.install()  # train.py did so first thing; this is for train() called alone
    # Check the config before joining the group: every rank then fails alike, and none
    # leaves a peer stuck in the group's set-up.
    validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    faults.check(int(os.environ.get("WORLD_SIZE", 1)))  # [Note: fault injection]
    heap.keep_freed_pages()  # a step reuses the last one's pages: [Note: keeping freed pages]
    env = tdist.init(cfg.dist.backend, cfg.dist.timeout_s)
    try:
        return train_in_group(cfg, env)
    except TrainingError:
        raise  # its own line already (ft's stall says "timed out" of a quorum, not a peer)
    except RuntimeError as e:
        failure = tdist.peer_failure(e, cfg.dist.timeout_s)
        if failure is None:
            raise
        raise failure from e
    finally:
        tdist.shutdown()


def train_in_group(cfg: DictConfig, env: tdist.DistEnv) -> dict[str, Any]:
    """The run, in a process group already set up (`train` sets it up and takes it down);
    returns what `finish` returns."""
    run = build_run(cfg, env)
    try:
        return _train_steps(cfg, run)
    finally:
        checkpoint.drop_save()  # a write still pending on an error: joined, not committed
        run.engine.close()  # an offload file removed
        run.replicas.close()


def _train_steps(cfg: DictConfig, run: Run) -> dict[str, Any]:
    start = run.start = checkpoint.maybe_resume(cfg, run.engine, run.run_dir, **run.resumable)
    if run.guard.check(preempt.requested())[1]:  # signalled during set-up: stop here
        raise preempt.Stopped.before_training(preempt.signal_name(), start)
    run.bar.update(start)
    run.done = start
    run.replicas.load_step(start)  # the step the replica groups count from
    comm.stats.reset()
    run.engine.train()
    every = run.every
    with maybe_profile(cfg.profile, run.run_dir, run.env.rank) as prof:
        while run.done < every.steps:
            before = run.done
            try:
                step = train_step(run, run.done + 1)  # later after a heal
            except TooFewGroups:  # stop with a checkpoint of the last step taken
                if run.done > run.start:
                    save_checkpoint(run, run.done, True)
                raise
            run.bar.update(step - before - 1)  # steps a heal brought
            checked = every.check(step)  # checkpoints are saved at check steps only
            stop = check_step(run, step) if checked else False
            if every.log(step):
                log_metrics(run, step)
            evals = every.eval(step)
            # eval and checkpoints between log points stay out of the step time
            with run.metrics.untimed() if checked or evals else nullcontext():
                if evals:  # of the model the groups agree on (DiLoCo: the global copy)
                    with run.replicas.global_copy():
                        run_eval(run, step)
                path = save_checkpoint(run, step, stop)
            run.bar.update(1)
            prof.step()
            if stop and step < every.steps:
                raise preempt.Stopped.at_step(step, path, preempt.signal_name())
    return finish(run)


@dataclass(frozen=True)
class Every:
    """The loop's step counts, read from the config once: an OmegaConf lookup costs tens
    of microseconds, about 1% of a small model's step when the loop asks a dozen times."""

    steps: int
    log_every: int
    eval_every: int  # 0: never
    ckpt_every: int  # 0: at the last step only
    grad_accum_steps: int
    skip_nonfinite: bool
    clip: float  # 0: no clipping

    @classmethod
    def of(cls, cfg: DictConfig) -> Every:
        train = cfg.train
        return cls(
            int(train.steps), int(train.log_every), int(train.eval_every or 0),
            int(cfg.ckpt.every or 0), int(train.grad_accum_steps),
            train.on_nonfinite == "skip", float(cfg.optim.clip_grad_norm or 0.0),
        )  # fmt: skip

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def eval(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0

    def check(self, step: int) -> bool:
        """Log steps, checkpoint steps and the last step: where the ranks compare notes."""
        every = self.ckpt_every
        return self.log(step) or bool(every and step % every == 0)


@dataclass
class Run:
    """What a training run holds from one step to the next."""

    cfg: DictConfig
    env: tdist.DistEnv
    run_dir: Path
    owner: rundir.Owner
    engine: Engine
    scheduler: Any
    batches: LoaderBatches | SlotBatches  # each step's batch: `take(step, slots)`
    eval_loader: Any
    writer: Rank0Writer
    metrics: IntervalMetrics
    bar: tqdm
    # Objects a checkpoint saves and restores through state_dict(), with the engine and
    # the RNG states.
    resumable: dict[str, Any]
    # the learning rate the last optimizer step taken used (a device tensor when fp16
    # decides on the device whether a step is taken)
    lr: float | torch.Tensor
    guard: Guard  # non-finite losses and stop requests (guard.py)
    every: Every  # the step counts of the config
    hooks: ModelHooks  # what the model adds to a step ([Note: model hooks])
    start: int = 0  # the step resumed from (0: none)
    done: int = 0  # the last step taken
    # the other replica groups of the run ([Note: fault-tolerant replica groups]); one
    # group without ft
    replicas: Replicas = field(default_factory=Replicas)
    skipped: int = 0  # steps skipped for a non-finite loss
    tokens_per_step: int = 0  # global tokens per step of a language model (0: not one)
    last: dict[str, float] = field(default_factory=dict)  # the latest logged metrics
    last_eval: dict[str, float] = field(default_factory=dict)
    # a language model's tokenizer for the evaluation sample (True: ids, no tokenizer);
    # None: not a language model
    sample_codec: Any = None


def build_run(cfg: DictConfig, env: tdist.DistEnv) -> Run:
    """Model, data, engine, schedule and writers, in an order that fixes the RNG draws: a
    resumed run must continue the same random streams."""
    run_dir = shared_run_dir(env)
    # Before anything of this run is written: one owner per directory.
    owner = rundir.claim(
        {"hydra.run.dir": run_dir, "ckpt.dir": checkpoint.checkpoint_dir(cfg, run_dir)}
    )
    names = _choice("model", cfg.model), _choice("data", cfg.data.dataset)
    # [Note: building on meta] in parallel/__init__.py: parameters without memory, the
    # engine allocates what its mode keeps and gives it values from `source`
    with empty_weights() if cfg.train.meta_build else nullcontext():
        model, dataset, held_out = model_and_data(cfg, names)  # seeded with cfg.seed
    source = None
    if not cfg.train.meta_build:
        model = model.to(env.device)
    else:  # buffers go to the device with the engine
        weights = getattr(model, "weights_dir", None)  # model=hf model.path=DIR with weights
        init = SeededInit(cfg.seed)
        source = init if weights is None else Pretrained(weights, init=init)
    psi = count_params(model)  # before fsdp takes the parameters apart
    # and before it empties them: the units DiLoCo's fragments are cut along
    fragment_of = fragments_for(cfg, model)
    # and before expert parallelism keeps n/E experts: 6 x this FLOPs per prediction
    flop_params = experts.active_params(model, psi)
    if not cfg.train.meta_build:  # a meta model runs its first forward in the engine below
        check_fit(model, dataset, *names)
    if env.is_rank0:  # what scripts/sample.py and export_hf.py rebuild the model from
        save_model_files(model, run_dir / "model", data_dir(dataset))
    ft = cfg.ft.enabled  # N replica groups of P ranks: the sampler deals N x P slots
    groups, group = (cfg.ft.replica_groups, cfg.ft.replica_group) if ft else (1, 0)
    slot, slots = group * env.world_size + env.rank, groups * env.world_size
    loader = make_loader(dataset, cfg.train.batch_size, slot, slots, cfg.seed)
    eval_loader = None
    if held_out is not None:
        eval_loader = make_eval_loader(
            held_out, cfg.train.batch_size, env.rank, env.world_size, cfg.train.eval_batches
        )
    link = cfg.get("comm") or {}
    if link.get("link_gbps") is not None and env.device.type == "cuda":
        raise ConfigError(
            f"comm.link_gbps={link.link_gbps} simulates a slow link on CPU (Gloo) runs only; "
            "on CUDA the network is real: unset comm.link_gbps"
        )
    comm.simulated_link(link.get("link_gbps"), link.get("latency_us", 0.0) / 1e6)
    optimizer = optimizer_factory(cfg.optim)
    engine = build_engine(
        model,
        cfg.mode.name,
        optimizer,
        precision=cfg.precision,
        loss_scale=OmegaConf.to_container(cfg.loss_scale),
        param_options=param_options(cfg.optim),
        source=source,
        device=env.device,
        **engine_options(cfg, run_dir),
    )
    if cfg.train.meta_build:  # every rank alike, so fsdp's collectives pair up
        check_fit(engine, dataset, *names, device=env.device)
    # After check_fit's forward of one sample: compiled for the training batch's shape
    if cfg.train.compile:  # each layer's forward, the same layers in every mode
        compile_layers(
            model,
            cfg.train.compile_backend,
            cfg.mode.get("unit_classes"),
            cfg.mode.get("repeated_children", True),
        )
    scheduler = lr_scheduler(
        engine.optimizer, cfg.optim, cfg.train.steps, on_device=engine.skips_on_device
    )

    writer = Rank0Writer(run_dir, env.is_rank0)
    writer.text("config", f"```\n{OmegaConf.to_yaml(cfg)}\n```")
    metrics = IntervalMetrics(
        env.device,
        memory=MemoryMonitor(engine, psi, cfg.train.peak_every),
        # forward 2Ψ + backward 4Ψ per prediction, Ψ of an MoE its top-k experts' only
        flops_per_token=6 * flop_params,
        peak_flops=peak_flops(env.device, engine.precision.param_dtype),  # None on CPU
    )
    bar = tqdm(total=cfg.train.steps, disable=not env.is_rank0, desc=_run_name(cfg, env))
    lr = scheduler.get_last_lr()[0]
    # draws from the RNG: before resuming, which restores it
    batches = SlotBatches(loader, env.rank, env.world_size) if ft else LoaderBatches(loader)
    resumable = {
        "sampler": loader.batch_sampler,
        "scheduler": scheduler,
        "loss_scaler": engine.scaler,
    }
    run = Run(
        cfg, env, run_dir, owner, engine, scheduler, batches, eval_loader, writer, metrics,
        bar, resumable, lr, Guard(env.device), Every.of(cfg), model_hooks(engine.module),
    )  # fmt: skip
    # As a step counts it, known before one runs: a run resumed at its last step (killed
    # between its last save and its end) runs none, and still reports its tokens seen.
    target = torch.as_tensor(dataset[0][1])  # a class label may be a plain int
    run.tokens_per_step = target.numel() * cfg.train.batch_size if target.dim() > 0 else 0
    if ft:  # joins the other groups: the last thing built, so a heal finds it all
        run.replicas = join_groups(
            cfg, env.rank, env.world_size, env.device, fingerprint(cfg, env.world_size),
            lambda: live_state(run), lambda state: load_live_state(run, state), engine,
            fragment_of,
        )  # fmt: skip
        # where the group's model began ([Note: a group's origin]), a sync in flight
        run.resumable.update(run.replicas.checkpointed())
    if getattr(model, "model_config", None) is not None:  # a language model: sampled
        model_dir = run_dir / "model"
        codec = codec_from_meta(read_meta(model_dir), model_dir) if env.is_rank0 else None
        run.sample_codec = True if codec is None else codec
    return run


def train_step(run: Run, step: int) -> int:
    """One optimizer step, or a skipped one; returns its number (with replica groups, a
    later one where this group healed from a peer). No host reads in a steady step: see
    [Note: checking the loss without a host sync] in guard.py; under ft torchft's commit
    is one ([Note: fault-tolerant replica groups] in comm/replicas.py)."""
    engine, every, replicas = run.engine, run.every, run.replicas
    run.metrics.start_step()  # the interval's first step syncs once: [Note: timing steps]
    while True:  # once without ft; again for a step that did not commit
        plan = replicas.start_step(step)  # a heal loads a peer's state in here
        step = plan.step
        batch = run.batches.take(step, plan.slots)
        # (inputs, targets, *extra): extra is what the model takes besides the inputs
        inputs, targets, *extra = (t.to(run.env.device, non_blocking=True) for t in batch)
        loss, correct = forward_backward(
            engine, inputs, targets, every.grad_accum_steps * len(plan.slots), run.hooks, extra
        )
        loss, correct = replicas.reduce(engine, loss, correct, len(plan.slots))
        if replicas.commit(step):
            break
        engine.zero_grad()  # redone, never half-applied
        run.hooks.after_step(False)
    run.done = step
    per_slot = targets.numel() // len(plan.slots)  # what one rank takes of a step
    if every.skip_nonfinite:
        if not run.guard.finite_now(loss):
            engine.zero_grad()  # drop this step's gradients on every rank alike
            run.hooks.after_step(False)  # and what the model kept of it (an MoE's counts)
            run.skipped += 1
            run.done = replicas.after_step(step)  # a sync due is due in every group
            return run.done
    else:
        run.guard.note(loss, step)
    grad_norm = engine.clip_grad_norm_(every.clip) if every.clip else None
    lr = run.scheduler.get_last_lr()[0]  # the lr this step uses
    # True, or False where fp16 gradients overflowed (no update, the loss scale lowered);
    # in fp16 a device flag, handed on unread ([Note: dynamic loss scaling])
    stepped = engine.step()
    run.hooks.after_step(stepped)  # the model's own update (an MoE's routing bias)
    run.scheduler.step(stepped)  # counts taken steps only
    run.lr = if_taken(stepped, lr, run.lr)
    # the slots the loss and count `reduce` returned are of: one rank's slot of each of
    # the N groups (every step), this group's own (between DiLoCo's syncs)
    counted = replicas.counted(len(plan.slots))
    per_rank = per_slot * counted
    run.tokens_per_step = per_rank * run.env.world_size if targets.dim() > 1 else 0
    run.metrics.add(
        loss,
        correct,
        per_rank,
        samples=targets.shape[0] // len(plan.slots) * counted,
        grad_norm=grad_norm,
        stepped=stepped,
    )
    # a fragment's sync across the groups (ft.semi_sync); later where a heal moved it
    run.done = replicas.after_step(step)
    return run.done


def live_state(run: Run) -> dict[str, Any]:
    """What a replica group heals from ([Note: live state] in parallel/state.py): this
    rank's engine, schedule, loss scale, RNG and last step, as CPU copies."""
    lr = run.lr.detach().cpu() if isinstance(run.lr, torch.Tensor) else run.lr
    return {
        "step": run.done,
        "engine": state.live_state(run.engine),
        "scheduler": run.scheduler.state_dict(),
        "loss_scaler": run.engine.scaler.state_dict(),
        "rng": rng_state(),
        "lr": lr,
        "skipped": run.skipped,
    }


def load_live_state(run: Run, sent: dict[str, Any]) -> None:
    """A peer's `live_state` into this rank (rank r of another group, the same layout)."""
    state.load_live_state(run.engine, sent["engine"])
    run.scheduler.load_state_dict(sent["scheduler"])
    run.engine.scaler.load_state_dict(sent["loss_scaler"])
    set_rng_state(sent["rng"])
    lr = sent["lr"]
    run.lr = lr.to(run.env.device) if isinstance(lr, torch.Tensor) else lr
    run.done, run.skipped = int(sent["step"]), int(sent["skipped"])


def fingerprint(cfg: DictConfig, world_size: int) -> int:
    """What every replica group of one run must share, hashed: the config but for the
    group's own index and where it writes, and the ranks per group."""
    keys = ("mode", "model", "data", "optim", "seed", "precision", "loss_scale", "train")
    shared = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig)
              else cfg[k] for k in keys}  # fmt: skip
    shared["ft.replica_groups"], shared["world_size"] = cfg.ft.replica_groups, world_size
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:5], "big")  # 40 bits: exact in a float64 sum of groups


def if_taken(stepped: bool | torch.Tensor, new: Any, old: Any) -> Any:
    """`new` where the step was taken, else `old`; on the device for a device flag."""
    if not isinstance(stepped, torch.Tensor):
        return new if stepped else old

    def on_device(v: Any) -> torch.Tensor:  # a fill, not a copy from the host
        return v if isinstance(v, torch.Tensor) else stepped.new_full((), v, dtype=torch.float64)

    return torch.where(stepped, on_device(new), on_device(old))


def save_checkpoint(run: Run, step: int, force: bool) -> Path | None:
    """A checkpoint at checkpoint steps, the last step and on a stop; with replica
    groups, by one of them (the lowest in the quorum)."""
    if not run.replicas.writes_checkpoints():
        faults.fault("step", step)  # [Note: fault injection], in every group
        return None
    return checkpoint.maybe_save(
        run.cfg, run.engine, run.run_dir, step, force=force, **run.resumable
    )


def check_step(run: Run, step: int) -> bool:
    """Raise if a loss was not finite since the last check (on every rank alike); return
    whether the run is to stop after this step."""
    first_bad, stop = run.guard.check(preempt.requested())
    if first_bad is not None:
        raise TrainingError(
            f"loss is not finite at step {first_bad}; lower optim.lr, or set "
            "train.on_nonfinite=skip to skip such steps"
        )
    # an async save: committed once written, its failure raised ([Note: async save])
    checkpoint.check_save(run.env.device)
    return stop


def log_metrics(run: Run, step: int) -> None:
    """Reduce the interval's metrics to rank 0, write them and show them on the bar."""
    scaler = run.engine.scaler
    latest = {"train/lr": run.lr}  # device values too: read with the metrics, at once
    latest.update(run.replicas.figures())  # ft/wait_ms_per_step: rank 0's
    latest.update(run.batches.figures(step))  # the data's own (a mix: tokens per source)
    if scaler.enabled:
        latest.update({"train/loss_scale": scaler.scale, "train/overflow_steps": scaler.skipped})
    figures = run.hooks.figures()  # the model's own (device values), mean over ranks
    values = run.metrics.reduce(latest, averaged=figures)
    if values:  # rank 0, with at least one step that was not skipped
        if figures:
            values.update(run.hooks.figures_to_log({k: values.pop(k) for k in figures}))
        shown = {"loss": f"{values['train/loss']:.4f}", "acc": f"{values['train/accuracy']:.3f}"}
        if run.tokens_per_step:
            values["train/tokens_seen"] = float(step * run.tokens_per_step)
            shown["tok/s"] = f"{values['perf/tokens_per_s']:.0f}"
        # final_metrics.json keeps the latest step-peak sample when the last interval had
        # none ([Note: what a step costs the monitor] in memory.py)
        run.last = {**{k: v for k, v in run.last.items() if "/peak_" in k}, **values}
        run.writer.scalars(values, step)
        run.bar.set_postfix(shown)


def run_eval(run: Run, step: int) -> None:
    values = evaluate(run.engine, run.eval_loader, run.env.device)
    if values:  # rank 0
        run.last_eval = values
        run.writer.scalars(values, step)
    if run.sample_codec is not None:
        write_sample(run, step)


SAMPLE_TOKENS = 64


def write_sample(run: Run, step: int) -> None:
    """A short sample of a language model to TensorBoard's text tab. Every rank runs the
    same forwards (an fsdp forward is a collective): ids drawn on the host from a
    generator seeded with the seed and the step, after token 0, in eval mode."""
    engine, codec = run.engine, run.sample_codec
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        ids = generate(
            engine,
            [0],
            SAMPLE_TOKENS,
            generator=torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step),
            window=positions(module),
            device=run.env.device,
        )
    finally:
        module.train(was_training)
    try:
        text = codec.decode(ids)
    except Exception:  # no tokenizer (True), or ids past its vocabulary (a padded model)
        text = " ".join(map(str, ids))
    run.writer.text("sample", f"step {step}:\n\n```\n{text}\n```", step)


def finish(run: Run) -> dict[str, Any]:
    """The final model and summary; returns the summary."""
    cfg, env, engine, run_dir, last = run.cfg, run.env, run.engine, run.run_dir, run.last
    if run.tokens_per_step and "train/tokens_seen" not in last:  # no step ran here
        last = {**last, "train/tokens_seen": float(cfg.train.steps * run.tokens_per_step)}
    run.bar.close()
    final = {
        "step": cfg.train.steps,
        "mode": cfg.mode.name,
        "shard_group_size": cfg.mode.get("shard_group_size"),
        "world_size": env.world_size,
        "skipped_steps": run.skipped,
        "overflow_steps": engine.scaler.total_skipped(),
        "run_dir": str(run_dir),
        **last,
        **run.last_eval,
    }
    if cfg.train.save_final:
        path = final_model_path(run_dir, engine.module)
        save_final_model(engine, path, env.is_rank0, run_dir / "model")
    run.writer.final(final)
    run.writer.close()
    run.owner.release()
    if env.is_rank0:
        print(
            f"done: {_mode_label(cfg)} on {env.world_size} rank(s), step {final['step']}, "
            f"{_outcome(run, last)} -> {run_dir}"
        )
    return final


def _outcome(run: Run, last: dict[str, float]) -> str:
    """The done line's figures; where there are none, what happened instead: no step
    ran (resumed at the last one: killed between its last save and its end), or every
    one was skipped for a non-finite loss (train.on_nonfinite=skip)."""
    if "train/loss" in last:
        return (
            f"loss {last['train/loss']:.4f}, accuracy {last['train/accuracy']:.3f}, "
            f"{_rate(last.get('perf/samples_per_s', 0))} samples/s{_eval_line(run)}"
        )
    steps = run.every.steps
    if run.start >= steps:
        return f"resumed at step {run.start} = train.steps: nothing to train"
    return (
        f"no loss to show: the {steps - run.start} step(s) run were all skipped for a "
        f"non-finite loss{_eval_line(run)}"
    )


def _rate(per_s: float) -> str:
    """A rate for the final line: whole numbers from 10 up, two significant digits below
    (a large model's 0.13 samples/s is not 0)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2g}"


def forward_backward(
    engine,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: int,
    hooks: ModelHooks | None = None,
    extra: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of this rank's batch, cut into `micro_batches` equal pieces.

    All but the last run under `engine.no_sync()`, entered before their forward: their
    gradients accumulate locally and the last backward communicates the sum, once. Each
    piece's loss is divided by their number, so the gradients equal those of the whole
    batch at once (where targets are ignored, of the mean of the pieces' means: [Note:
    what the loss is averaged over] in models/loss.py). `extra`: tensors of the batch the
    model takes after the inputs (token data's segments), cut alike: `engine(x, *extra)`.
    The model's extra loss, if it has one (`hooks`, by default looked up on
    engine.module: [Note: model hooks]), is added to each piece's loss. Returns the
    batch's mean loss and number of correct predictions (accuracy x piece size, summed).
    """
    hooks = model_hooks(engine.module) if hooks is None else hooks
    loss_sum = correct = torch.zeros((), device=inputs.device)
    cut = [t.chunk(micro_batches) for t in (inputs, targets, *extra)]
    pieces = list(zip(*cut, strict=True))
    for i, (x, y, *more) in enumerate(pieces):
        with engine.no_sync() if i < len(pieces) - 1 else nullcontext():
            logits = engine(x, *more)
            loss = loss_fn(logits, y)
            aux = hooks.extra_loss()  # an MoE's load balancing, as the model asks
            if aux is not None:
                loss = loss + aux
            loss = loss / len(pieces)
            engine.backward(loss)
        loss_sum = loss_sum + loss.detach()
        correct = correct + accuracy(logits, y) * y.numel()
    return loss_sum, correct


def _eval_line(run: Run) -> str:
    e = run.last_eval
    if "eval/perplexity" in e:
        rate = run.last.get("perf/tokens_per_s")
        tokens = f", {rate:.0f} tokens/s" if run.tokens_per_step and rate is not None else ""
        return f"{tokens}, val loss {e['eval/loss']:.4f}, perplexity {e['eval/perplexity']:.2f}"
    return f", eval loss {e['eval/loss']:.4f}" if "eval/loss" in e else ""


def _mode_label(cfg: DictConfig) -> str:
    """The mode, and its shard groups when hybrid ([Note: hybrid sharding])."""
    s = cfg.mode.get("shard_group_size")
    return cfg.mode.name if s is None else f"{cfg.mode.name} (shard groups of {s})"


def _run_name(cfg: DictConfig, env: tdist.DistEnv) -> str:
    return f"{_mode_label(cfg)} p={env.world_size}"


def _choice(group: str, node: DictConfig) -> str:
    """The config group's choice as the user named it (`gpt`), else its target."""
    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get(group)
        if choice:
            return str(choice)
    return str(node.get("_target_", group))
