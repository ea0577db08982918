"""Sharded, atomic checkpoints: save, resume (also into another mode or world size) and
consolidate into one state_dict. What they give a user: docs/checkpoints.md.

    start = checkpoint.maybe_resume(cfg, engine, run_dir, sampler=sampler)   # before the loop
    checkpoint.maybe_save(cfg, engine, run_dir, step, sampler=sampler)       # after each step
    checkpoint.check_save(device)    # at check steps: commit an async save, or end on its error

Read saving.py and resume.py first; files.py pictures a checkpoint on disk. Each module's
docstring names the notes that explain it ([Note: atomic checkpoints] is saving.py's).
  files.py       the directory and file format: checksummed writes, checked reads
  storage.py     reads retried, then named: a storage error is not damage
  stream.py      tensors streamed to a data file in one buffer, ranges read back and checked
  saving.py      every rank writes, rank 0 commits by a rename
  background.py  ckpt.async: the write on a thread, the commit on the main thread
  resume.py      which checkpoint to resume (the run's lineage), loading it into an engine
  recutting.py   what a rank keeps, in its layout or another; the full model, tensor by tensor
  export.py      that model as safetensors, one tensor at a time
  rng.py         each rank's RNG states
  agree.py       what every rank must learn alike (errors, rank 0's decisions, who finds a file)
  faults.py      a schedule of faults at chosen points, for tests and scripts/chaos.py
"""

from trainer.checkpoint.background import check as check_save
from trainer.checkpoint.background import drop as drop_save
from trainer.checkpoint.background import finish as finish_save
from trainer.checkpoint.files import (
    checkpoint_dir,
    find_checkpoints,
    read_meta,
    read_rank,
    step_dir,
    write_file,
)
from trainer.checkpoint.recutting import consolidate
from trainer.checkpoint.resume import check_config, load, maybe_resume
from trainer.checkpoint.saving import maybe_save, save

__all__ = [
    "check_config",
    "check_save",
    "drop_save",
    "finish_save",
    "checkpoint_dir",
    "consolidate",
    "find_checkpoints",
    "load",
    "maybe_resume",
    "maybe_save",
    "read_meta",
    "read_rank",
    "save",
    "step_dir",
    "write_file",
]
