"""The training run: what happens between `python train.py ...` and the last checkpoint.

- cli.py: the command line, bad input as one line, launcher.nproc's local workers.
- loop.py: build_run, train_step, log_metrics, run_eval, finish (never branches on the
  mode or the model: trainer/models/hooks.py). Start here.
- guard.py: non-finite losses and stop requests, agreed at check steps; fit.py: does
  the model take the data; preempt.py: a clean stop on SIGTERM; rundir.py: one owner
  per run directory; profiling.py: profile=true traces.
- dist.py: the process group and device from torchrun's environment; optim.py: the optim
  group's weight-decay groups and learning-rate schedule.

The config it runs (trainer/config/) is shared with the estimator (trainer/estimate/); the
engines are trainer/parallel/.
"""
