"""How mode=fsdp cuts a model into units, and which unit each parameter belongs to:
[Note: unit policy] beside `_choose` says which submodules become units, [Note: tied
parameters] beside `plan_units` where a parameter two units reach goes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

DEFAULT_UNIT_CLASSES = ("Block", "BasicBlock", "Bottleneck")


@dataclass
class UnitPlan:
    name: str  # module path; "" for the root
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # (name, param)


# [Note: tied parameters]
# A parameter reachable from two units (GPT's `lm_head.weight is wte.weight`, or a module
# registered under two parents) cannot live in either alone: the other unit would run with
# it freed. It goes to the root, the unit enclosing both (units never nest), whose forward
# spans both uses. Units left without parameters are dropped.


def plan_units(
    model: nn.Module,
    unit_classes: Sequence[str] = DEFAULT_UNIT_CLASSES,
    min_unit_params: int = 100_000,
    repeated_children: bool = True,
) -> list[UnitPlan]:
    """The root first, then the other units in module registration (pre-)order."""
    chosen = _choose(model, set(unit_classes), min_unit_params, repeated_children)
    plan = [UnitPlan("", model)]
    plan += [UnitPlan(n, m) for n, m in model.named_modules() if id(m) in chosen and n]
    index = {id(u.module): i for i, u in enumerate(plan)}

    # Every unit that reaches each parameter, walking all paths (shared modules included).
    reach: dict[int, list[int]] = {}

    def walk(module: nn.Module, unit: int) -> None:
        i = index.get(id(module), unit)
        for p in module._parameters.values():
            if p is not None and i not in reach.setdefault(id(p), []):
                reach[id(p)].append(i)
        for child in module._modules.values():
            if child is not None:
                walk(child, i)

    walk(model, 0)
    for name, p in model.named_parameters():  # deduplicated, registration order
        # Reached from two units: the root's ([Note: tied parameters]).
        units = reach[id(p)]
        plan[units[0] if len(units) == 1 else 0].params.append((name, p))
    return [u for i, u in enumerate(plan) if i == 0 or u.params]


# [Note: unit policy]
# A unit is a submodule whose parameters are gathered and freed together. Three rules pick
# them, in this order of precedence:
#   1. by class: a submodule whose class name is in `unit_classes` (transformer `Block`,
#      resnet `BasicBlock`, ...) is a unit with its whole subtree; the outermost one wins.
#   2. by repetition (`repeated_children`, on by default): the children of a ModuleList or
#      Sequential that share their class with at least one sibling are units, whatever
#      their size, each with its whole subtree: HF GPT-2's `transformer.h.*`, Llama's
#      `model.layers.*`, timm's `blocks.*`, an MLP's hidden Linears. This is what FSDP2
#      users write by hand (`for layer in model.layers: fully_shard(layer)`), and the
#      layers of a small model would never reach `min_unit_params`. A child qualifies only
#      with parameters and a forward of its own (a nested ModuleList has none: nothing
#      would call the hooks that gather its parameters; it is searched instead), and only
#      if no class named in rule 1 lies inside it: naming a class is how a user picks a
#      finer cut (`unit_classes=[FeedForward]` makes each block's MLP the unit, not the
#      block). The outermost repetition wins: a layer's own Sequentials are not cut again.
#   3. by size: outside those subtrees, a submodule with a forward of its own and no unit
#      inside it that holds at least `min_unit_params` parameters (embeddings, an LM head;
#      with `repeated_children=False` also every large enough layer and, inside a layer
#      that is not a unit, its large Linears).
# The root unit is the model itself and holds every parameter left over, among them those
# of a module that encloses units (HF GPT-2's `transformer`: `wpe` and `ln_f` around the
# blocks). Such a module's parameters are needed before and after the units inside it, in
# forward and again in backward, where its output's gradient comes first: as a unit of its
# own, gathering it there would force the AllGathers of every unit inside it ahead of it
# ([Note: one collective order on every rank] in schedule.py), all units full at once. In
# the root they stay gathered through the step, as the root's do.


def _choose(model: nn.Module, classes: set[str], min_params: int, repeated: bool) -> set[int]:
    """ids of the modules that become units ([Note: unit policy])."""
    by_class = units_by_class(model, classes)
    whole = by_class | (units_by_repetition(model, by_class) if repeated else set())
    return whole | _by_size(model, whole, min_params)


def _has_forward(module: nn.Module) -> bool:
    # A ModuleList or ModuleDict has none: nothing would call a unit's gathering hooks.
    return type(module).forward is not nn.Module.forward


def units_by_class(model: nn.Module, classes: set[str]) -> set[int]:
    """Rule 1: the outermost submodules whose class name is in `classes`."""
    found: set[int] = set()
    seen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not is_root and type(module).__name__ in classes:
            found.add(id(module))
            return
        for child in module._modules.values():
            if child is not None:
                visit(child, False)

    visit(model, True)
    return found


def _repeated(container: nn.Module) -> list[nn.Module]:
    """The children of a ModuleList/Sequential that share their class with a sibling and
    have parameters and a forward of their own."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return []
    children = list({id(c): c for c in container._modules.values() if c is not None}.values())
    counts = Counter(type(c) for c in children)
    return [
        c
        for c in children
        if counts[type(c)] >= 2 and _has_forward(c) and any(True for _ in c.parameters())
    ]


def units_by_repetition(model: nn.Module, by_class: set[int]) -> set[int]:
    """Rule 2: repeated children, outermost first, that hold no unit of rule 1."""
    found: set[int] = set()
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen or id(module) in by_class:
            return
        seen.add(id(module))
        repeated = {id(c) for c in _repeated(module)}
        for child in module._modules.values():
            if child is None:
                continue
            if id(child) in repeated and not any(id(m) in by_class for m in child.modules()):
                found.add(id(child))  # its whole subtree: not searched further
                seen.add(id(child))
            else:
                visit(child)

    visit(model)
    return found


def _by_size(model: nn.Module, whole: set[int], min_params: int) -> set[int]:
    """Rule 3, decided bottom-up: modules outside the subtrees of `whole`, with no unit
    inside them, holding at least `min_params` parameters ([Note: unit policy])."""
    found: set[int] = set()
    seen: set[int] = set()  # modules and parameters already counted once

    def visit(module: nn.Module, is_root: bool) -> tuple[int, bool]:
        """(its parameters not in a unit, whether a unit lies inside it)"""
        if id(module) in seen:
            return 0, id(module) in whole or id(module) in found
        seen.add(id(module))
        if not is_root and id(module) in whole:
            return 0, True
        n, encloses = 0, False
        for child in module._modules.values():
            if child is not None:
                k, inside = visit(child, False)
                n, encloses = n + k, encloses or inside
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        if not is_root and not encloses and n >= min_params and _has_forward(module):
            found.add(id(module))
            return 0, True
        return n, encloses

    visit(model, True)
    return found
