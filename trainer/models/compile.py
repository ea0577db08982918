"""train.compile=true: each layer's forward compiled with torch.compile, as torchtitan
compiles each transformer block, the same way in every mode: which layers, and why their
forward and not their hooks, in [Note: compiling layers, not their hooks] beside
`layers`. The first steps include compilation (seconds per distinct layer class
on a CPU, with a C++ compiler for the default `inductor` backend;
`train.compile_backend=aot_eager` needs none and only traces).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.parallel.units import DEFAULT_UNIT_CLASSES, units_by_class, units_by_repetition

# [Note: compiling layers, not their hooks]
# Which modules: the layers that mode=fsdp makes units of by class and by repetition
# (units.py [Note: unit policy], rules 1 and 2): GPT's `blocks.*`, HF GPT-2's
# `transformer.h.*`, Llama's `model.layers.*`, resnet's residual blocks, an MLP's hidden
# Linears. ddp and zero compile the very same layers, so a mode changes what is
# communicated, never what is compiled. Embeddings, the final norm and the LM head stay
# eager (torchtitan does the same).
#
# What is compiled: the layer's own `forward`, set on the instance
# (`layer.forward = torch.compile(layer.forward)`), not `layer.compile()`.
# `nn.Module.compile()` compiles `_call_impl`, the call *with its hooks*: dynamo then
# traces fsdp's pre- and post-forward hooks, which launch AllGathers, resize storages and
# swap `p.data` ([Note: parameters as views of one storage] in fsdp_units.py). It cannot trace
# those and breaks the graph inside each hook (measured: 12 graph breaks in 3 steps of a
# 2-block GPT at 2 ranks, each a resume function compiled on its own; the results were
# still equal, but the engine's collectives then run between dynamo's pieces). Compiling
# the forward alone leaves the hooks outside: `nn.Module.__call__` runs them eagerly
# around the compiled forward, so every engine sees the same module calls, the same
# parameter objects and an autograd graph it can walk (the compiled forward is one
# autograd node whose inputs include the layer's parameters: their AccumulateGrad nodes
# and post-accumulate-grad hooks fire as before, and fsdp's walk from the outputs to the
# parameters finds them). No graph breaks in any mode (tests/test_compile.py).
#
# A layer's parameters are inputs of its graph (dynamo's inlining of nn modules), so the
# layers of one class share one compiled graph per grad mode (training; evaluation under
# no_grad), whatever the depth, and fsdp's gathered parameters (same shapes, new storage
# after every AllGather) do not recompile. The state_dict keeps its keys (no
# `_orig_mod.` prefix), so checkpoints and exports are those of an eager run, and a run
# can resume with or without compilation. Activation checkpointing composes: its
# recomputation calls the layer again, hooks and compiled forward alike.


def layers(
    model: nn.Module,
    unit_classes: Sequence[str] | None = None,
    repeated_children: bool = True,
) -> list[tuple[str, nn.Module]]:
    """(name, module) of the layers fsdp makes units of by class and by repetition, in
    registration order ([Note: compiling layers, not their hooks])."""
    classes = set(DEFAULT_UNIT_CLASSES if unit_classes is None else unit_classes)
    by_class = units_by_class(model, classes)
    chosen = by_class | (units_by_repetition(model, by_class) if repeated_children else set())
    return [(n, m) for n, m in model.named_modules() if n and id(m) in chosen]


def compile_layers(
    model: nn.Module,
    backend: str = "inductor",
    unit_classes: Sequence[str] | None = None,
    repeated_children: bool = True,
) -> list[str]:
    """Compile the forward of each of `model`'s layers in place; returns their names.
    `unit_classes`, `repeated_children`: fsdp's unit options (mode.*), for the same
    layers fsdp shards."""
    found = layers(model, unit_classes, repeated_children)
    if not found:
        raise ConfigError(
            f"train.compile=true: {type(model).__name__} has no repeated layers, nor any of "
            f"the classes {sorted(unit_classes or DEFAULT_UNIT_CLASSES)}, to compile layer by "
            "layer; set train.compile=false"
        )
    try:
        for _, module in found:
            # the bound method of this instance; nn.Module.__call__ calls it between hooks
            module.forward = torch.compile(module.forward, backend=backend)
    except Exception as e:  # an unknown backend name is refused here, not at the first step
        raise ConfigError(f"train.compile_backend={backend!r}: {e}".splitlines()[0]) from e
    return [n for n, _ in found]
