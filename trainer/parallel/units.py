"""How mode=fsdp cuts a model into units, and which unit each parameter belongs to.

[Note: unit policy]
A unit is a submodule whose parameters are gathered and freed together. Walking the
module tree, a submodule becomes a unit when
  1. its class name is in `unit_classes` (transformer `Block`, resnet `BasicBlock`, ...);
     its whole subtree then belongs to it, or else
  2. it holds at least `min_unit_params` parameters that no inner unit has already
     taken, and it has a forward of its own (a ModuleList has none: nothing would call
     the hooks that gather its parameters).
The root unit is the model itself and holds every parameter left over.

[Note: tied parameters]
A parameter reachable from two units (GPT's `lm_head.weight is wte.weight`, or a module
registered under two parents) cannot live in either alone: the other unit would run with
it freed. It goes to the innermost unit enclosing both, the root at worst, whose forward
spans both uses. Units left without parameters are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

DEFAULT_UNIT_CLASSES = ("Block", "BasicBlock", "Bottleneck")


@dataclass
class UnitPlan:
    name: str  # module path; "" for the root
    module: nn.Module
    parent: int | None  # index of the enclosing unit in the plan; None for the root
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # (name, param)


def plan_units(
    model: nn.Module,
    unit_classes: Sequence[str] = DEFAULT_UNIT_CLASSES,
    min_unit_params: int = 100_000,
) -> list[UnitPlan]:
    """The root first, then the other units in module registration (pre-)order."""
    chosen = _choose(model, set(unit_classes), min_unit_params)
    plan = [UnitPlan("", model, None)]
    plan += [UnitPlan(n, m, None) for n, m in model.named_modules() if id(m) in chosen and n]
    index = {id(u.module): i for i, u in enumerate(plan)}

    # Every unit that reaches each parameter, walking all paths (shared modules included).
    reach: dict[int, list[int]] = {}

    def walk(module: nn.Module, unit: int) -> None:
        i = index.get(id(module), unit)
        if i != unit and plan[i].parent is None and i != 0:
            plan[i].parent = unit
        for p in module._parameters.values():
            if p is not None and i not in reach.setdefault(id(p), []):
                reach[id(p)].append(i)
        for child in module._modules.values():
            if child is not None:
                walk(child, i)

    walk(model, 0)
    for name, p in model.named_parameters():  # deduplicated, registration order
        owner = reach[id(p)][0]
        for other in reach[id(p)][1:]:  # [Note: tied parameters]
            owner = _common_ancestor(plan, owner, other)
        plan[owner].params.append((name, p))

    kept = [i for i, u in enumerate(plan) if i == 0 or u.params]
    new = {old: k for k, old in enumerate(kept)}
    for i in kept[1:]:
        parent = plan[i].parent
        while parent not in new:
            parent = plan[parent].parent
        plan[i].parent = new[parent]
    return [plan[i] for i in kept]


def _choose(model: nn.Module, classes: set[str], min_params: int) -> set[int]:
    """ids of the modules that become units ([Note: unit policy]), decided bottom-up."""
    chosen: set[int] = set()
    seen: set[int] = set()  # modules and parameters already counted once

    def visit(module: nn.Module, is_root: bool) -> int:  # -> parameters not in a unit
        if id(module) in seen:
            return 0
        seen.add(id(module))
        if not is_root and type(module).__name__ in classes:
            chosen.add(id(module))
            return 0
        n = sum(visit(c, False) for c in module._modules.values() if c is not None)
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        callable_ = type(module).forward is not nn.Module.forward
        if not is_root and n >= min_params and callable_:
            chosen.add(id(module))
            return 0
        return n

    visit(model, True)
    return chosen


def _common_ancestor(plan: list[UnitPlan], a: int, b: int) -> int:
    ancestors = set()
    while a is not None:
        ancestors.add(a)
        a = plan[a].parent
    while b not in ancestors:
        b = plan[b].parent
    return b
