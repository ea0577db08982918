"""Models built without memory, and their values given module by module.

`with empty_weights(): model = build()` registers every parameter on the meta device
(shape and dtype, no storage) and leaves buffers real. An engine then allocates only what
its mode keeps and asks a `Source` for the values of those elements:

    source.fill(root, modules, requests, device)

`SeededInit(seed)` runs each module's own initialisation ([Note: initialising by module]);
`Pretrained(directory)` reads a saved model's values slice by slice (trainer/models/weights.py).
`materialize(root, source, device)` is the whole-model case (ddp, zero): afterwards the
model is an ordinary one on `device`.

Parameters keep their identity throughout: a value is put in place by swapping the
tensor's contents (`torch.utils.swap_tensors`), because `p.data = t` refuses to move a
parameter between the meta device and a real one, and `module.to_empty()` makes new
Parameter objects, which would untie tied weights (one Parameter reachable from two
modules, e.g. an embedding and the LM head).

A tied parameter is one parameter: it belongs to the module under whose name
`root.named_parameters()` lists it (the first module to register it, the embedding of an
embedding/head pair) and only that module's initialisation gives it values, however the
modules are grouped into calls.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainer.errors import ConfigError

META = torch.device("meta")


# --------------------------------------------------------------------------------------
# Building empty


@contextmanager
def empty_weights() -> Iterator[None]:
    """Inside it, every parameter an nn.Module registers is put on the meta device; buffers
    stay real (a rotary embedding's frequencies, BatchNorm's statistics: cheap, and some
    cannot be recomputed by an init). Each parameter is still created for real first, by
    the module's constructor, then replaced: one parameter's memory at a time. A parameter
    already on meta is kept as it is, so ties made in a constructor
    (`self.head.weight = self.emb.weight`) stay ties."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device != META:
            module._parameters[name] = parameter_like(param, param.detach().to(META))

    global _building_on_meta
    nn.Module.register_parameter = register_on_meta
    inits = {name: getattr(nn.init, name) for name in _INITS}
    for name, init in inits.items():
        setattr(nn.init, name, _skipping_meta(init))
    outer, _building_on_meta = _building_on_meta, True
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, init in inits.items():
            setattr(nn.init, name, init)
        _building_on_meta = outer


# torch.nn.init's in-place initialisers, which constructors call on the parameters they
# have just registered (on meta, here): there is nothing to write. Skipped rather than run:
# `normal_` on a meta tensor imports torch's Python meta kernels (and sympy with them),
# 1.6 s of CPU once per process for a call that does nothing.
_INITS = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]


def _skipping_meta(init: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def skipped_on_meta(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return tensor if tensor.is_meta else init(tensor, *args, **kwargs)

    return skipped_on_meta


_building_on_meta = False


def building_on_meta() -> bool:
    """Inside `empty_weights()`: builders that would load weights whole (from_pretrained)
    build empty instead and leave the values to a Pretrained source."""
    return _building_on_meta


def has_meta(root: nn.Module) -> bool:
    """Whether `root`'s parameters are on the meta device (built under empty_weights()).
    A model with some parameters on meta and some not is refused, naming one of each:
    no engine knows which values to keep."""
    on_meta, real = None, None
    for name, p in root.named_parameters():
        if p.device == META:
            on_meta = on_meta or name
        else:
            real = real or name
    if on_meta and real:
        raise ConfigError(
            f"the model has parameters on the meta device ({on_meta}) and others that are "
            f"not ({real}): build all of it under trainer.models.materialize.empty_weights(), or "
            "none of it"
        )
    return on_meta is not None


# --------------------------------------------------------------------------------------
# The interface engines use


@dataclass
class Request:
    """One parameter's elements a rank needs."""

    name: str  # the parameter's name in root.named_parameters()
    param: nn.Parameter  # on the meta device (shape, dtype)
    start: int  # range of its flattened elements, [start, stop)
    stop: int
    out: Tensor  # 1-D, stop - start elements, on the target device; written (cast to its dtype)


class Source:
    """Where a model's values come from."""

    def fill(
        self,
        root: nn.Module,
        modules: Sequence[tuple[str, nn.Module]],
        requests: Sequence[Request],
        device: torch.device | str,
    ) -> None:
        """Values for parameters owned (recurse=False) by `modules` (qualified names in
        root.named_modules()): each request's elements written into its `out`. Meta
        buffers of these modules are materialised whole on `device`, in place in the
        module, and given values. Parameters stay on meta: nothing of the caller's model is
        left allocated except buffers and `out`. A request may name a parameter whose
        module is not among `modules` (a tied weight an engine keeps with another unit):
        it is served all the same."""
        raise NotImplementedError


def materialize(
    root: nn.Module, source: Source, device: torch.device | str, only_meta: bool = False
) -> nn.Module:
    """Every parameter of `root` allocated whole on `device` and given `source`'s values
    (tied ones once, identity kept), meta buffers materialised: afterwards `root` is an
    ordinary model on `device`. For modes that keep full parameters (ddp, zero). Real
    parameters and buffers are moved to `device` too. Returns `root`. `only_meta`: the
    parameters on meta get values and the real ones stay as they are (expert parameters
    given their rank's rows first, trainer/parallel/experts.py)."""
    device = torch.device(device)
    if only_meta:
        if not any(p.is_meta for p in root.parameters()):
            return root.to(device)
    elif not has_meta(root):
        return root.to(device)
    params = [(n, p) for n, p in root.named_parameters() if p.is_meta]
    # The values are written into tensors of their own while the model's parameters stay
    # on meta (as fill expects), then each parameter takes its tensor.
    storage = [torch.empty(p.shape, dtype=p.dtype, device=device) for _, p in params]
    requests = [
        Request(name, p, 0, p.numel(), s.view(-1))
        for (name, p), s in zip(params, storage, strict=True)
    ]
    modules = list(root.named_modules())
    if only_meta:  # modules whose own parameters have values already are left alone
        modules = [(n, m) for n, m in modules if not any(
            p is not None and not p.is_meta for p in m._parameters.values()
        )]  # fmt: skip
    source.fill(root, modules, requests, device)
    for (_, p), s in zip(params, storage, strict=True):
        swap_into(p, s)
    return root.to(device)  # buffers that were real elsewhere


# --------------------------------------------------------------------------------------
# SeededInit

# [Note: initialising by module]
#
# An ordinary build draws every parameter from one RNG stream, in construction order: a
# parameter's values depend on everything drawn before it. An engine that builds only its
# shards, unit by unit, cannot reproduce that stream without drawing (and so holding) the
# whole model. SeededInit gives each module a stream of its own instead: before a
# module's init runs, the RNG of the device is seeded from a stable hash of (seed, the
# module's qualified name). A module's values then depend on nothing but the seed and its
# name, so any grouping of modules into fill calls (the whole model at once, fsdp's units
# one by one), any slicing of a parameter among ranks, and any world size give bitwise the
# same initial model. The init itself is the module's own (Hugging Face's _init_weights,
# our models' init_module, torch's reset_parameters), so each tensor has the distribution
# of the ordinary build's: the same distribution, not the same draws. Values differ from
# `torch.manual_seed(seed); build()` and from one device type to another.
#
# Some inits write a child's parameters from the parent (GPT-2's attention rescales its
# c_proj weight; nn.MultiheadAttention zeroes its out_proj bias). Construction runs inits
# children first, parents after, so a parameter's final values are its module's init
# followed by its ancestors'. SeededInit does the same for each module, with only that
# module's parameters allocated; an ancestor's init, seeded from (seed, module, ancestor),
# writes nothing but them (the rest is on meta, where writes are no-ops).


class SeededInit(Source):
    """Each module's own initialisation, seeded by (seed, its qualified name)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def fill(
        self,
        root: nn.Module,
        modules: Sequence[tuple[str, nn.Module]],
        requests: Sequence[Request],
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        check_requests(requests)
        owners = param_owners(root)
        by_module: dict[str, list[Request]] = {}
        for r in requests:
            by_module.setdefault(owners[id(r.param)][0], []).append(r)
        listed = {name for name, _ in modules}
        # A request for a whole parameter, in its dtype and on `device` (materialize): the
        # init writes into its `out` directly, with no transient copy of the module.
        whole = {
            id(r.param): r
            for r in requests
            if (r.start, r.stop) == (0, r.param.numel())
            and r.out.dtype == r.param.dtype
            and r.out.device == device
            and r.out.is_contiguous()
        }
        # Post-order, as construction runs inits (a module's values do not depend on it).
        todo = [(n, m) for n, m in _post_order(root) if n in listed or n in by_module]
        devices = [device.index] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            for name, module in todo:
                own = [
                    (attr, p)
                    for attr, p in module._parameters.items()
                    if p is not None and owners[id(p)][0] == name
                ]
                meta_buffers = (
                    [(b, t) for b, t in module._buffers.items() if t is not None and t.is_meta]
                    if name in listed
                    else []
                )
                if not own and not meta_buffers:
                    continue
                real = [attr for attr, p in own if not p.is_meta]
                if real:  # its init would overwrite them
                    raise ValueError(
                        f"fill expects module {name or '(root)'}'s parameters on the meta "
                        f"device; {qualified(name, real[0])} is not"
                    )
                # transformers' init functions skip a tensor flagged as initialised (what
                # from_pretrained loaded): the flag is put back with the meta tensor.
                flags = [p.__dict__.pop("_is_hf_initialized", None) for _, p in own]
                self._init_one(root, name, module, own, meta_buffers, device, whole)
                for r in by_module.get(name, []):
                    if whole.get(id(r.param)) is not r:  # else written in place
                        r.out.copy_(_values(r.param).view(-1)[r.start : r.stop])
                for (_, p), flag in zip(own, flags, strict=True):
                    swap_into(p, torch.empty(p.shape, dtype=p.dtype, device=META))
                    if flag is not None:
                        p._is_hf_initialized = flag

    def _init_one(
        self,
        root: nn.Module,
        name: str,
        module: nn.Module,
        own: list[tuple[str, nn.Parameter]],
        meta_buffers: list[tuple[str, Tensor]],
        device: torch.device,
        whole: dict[int, Request],
    ) -> None:
        """Run the inits that give `module`'s own parameters and meta buffers values, with
        them allocated on `device` and everything else left as it is. NaN fills and
        version counters show what an init left unset."""
        chain = _ancestors(root, name)  # (name, module) from `module` up to root
        init = _init_for(chain)
        if init is None:
            what = own[0][0] if own else meta_buffers[0][0]
            kind = "parameter" if own else "meta buffer"
            raise ConfigError(
                f"module {name or '(root)'} ({type(module).__name__}) has {kind} {what} and "
                "no initialisation: no enclosing Hugging Face PreTrainedModel, no "
                "init_module(module) method on the model, no reset_parameters(); build it "
                "ordinarily, or give it values with Pretrained(...)"
            )
        for _, p in own:
            into = whole.get(id(p))
            if into is None:
                swap_into(p, _nan(p.shape, p.dtype, device))
            else:  # NaN first, as the transient tensor would be
                values = into.out.view(p.shape)
                if values.is_floating_point() or values.is_complex():
                    values.fill_(math.nan)
                swap_into(p, values)
        placed = {}
        for b, t in meta_buffers:
            module._buffers[b] = placed[b] = _nan(t.shape, t.dtype, device)
        versions = {b: t._version for b, t in placed.items()}
        for i, (ancestor, _) in enumerate(chain):
            run = init if i == 0 else _init_for(chain[i:])
            if run is None:
                continue
            _seed(device, _stable_seed(self.seed, name, ancestor if i else None))
            with torch.no_grad():
                run(chain[i][1])
        for attr, p in own:
            if module._parameters.get(attr) is not p:  # the init registered a new Parameter
                new = module._parameters[attr]
                module._parameters[attr] = p
                with torch.no_grad():
                    _values(p).copy_(new.detach())
            if _has_nan(_values(p)):
                raise ConfigError(
                    f"the init of module {name or '(root)'} ({type(module).__name__}) left "
                    f"parameter {qualified(name, attr)} unset: give the model an "
                    "init_module(module) that covers it"
                )
        for b, t in placed.items():
            now = module._buffers.get(b)
            restored = (now is not t and now is not None and not now.is_meta) or (
                now is t and t._version != versions[b] and not _has_nan(t)
            )
            if not restored:
                raise ConfigError(
                    f"buffer {qualified(name, b)} of module {name or '(root)'} "
                    f"({type(module).__name__}) is on the meta device and its init does not "
                    "restore it: build the model under trainer.models.materialize.empty_weights(), "
                    "which keeps buffers real"
                )
            if now.device != device:
                module._buffers[b] = now.to(device)


def _init_for(chain: list[tuple[str, nn.Module]]) -> Callable[[nn.Module], Any] | None:
    """The init that construction would run for chain[0][1] (chain: the module, then its
    ancestors up to the root): its nearest enclosing Hugging Face PreTrainedModel's
    `_init_weights`, else the nearest enclosing model's `init_module` (ours, e.g. GPT),
    else the module's own `reset_parameters`."""
    pretrained = _pretrained_class()
    for _, m in chain:
        if pretrained is not None and isinstance(m, pretrained):
            return m._init_weights
        if callable(getattr(m, "init_module", None)):
            return m.init_module
    module = chain[0][1]
    if callable(getattr(module, "reset_parameters", None)):
        return lambda m: m.reset_parameters()
    return None


def _pretrained_class() -> type | None:
    # Only an imported transformers can have built a PreTrainedModel: no import here.
    mod = sys.modules.get("transformers")
    return getattr(mod, "PreTrainedModel", None) if mod is not None else None


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, qualified(prefix, name))
    yield prefix, module


def _ancestors(root: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    parts = name.split(".") if name else []
    chain = [("", root)]
    for i in range(len(parts)):
        chain.append((".".join(parts[: i + 1]), chain[-1][1].get_submodule(parts[i])))
    return chain[::-1]


def _stable_seed(seed: int, name: str, ancestor: str | None) -> int:
    # Python's hash() of a str changes from process to process: blake2b does not.
    key = f"{seed}\0{name}" if ancestor is None else f"{seed}\0{name}\0{ancestor}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _seed(device: torch.device, seed: int) -> None:
    """Seed the CPU's generator (some inits draw there and copy) and `device`'s."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index].manual_seed(seed)
    elif device.type != "cpu":
        with torch.get_device_module(device.type).device(device):
            torch.get_device_module(device.type).manual_seed(seed)


# --------------------------------------------------------------------------------------
# Helpers shared with trainer/models/weights.py


def param_owners(root: nn.Module) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (qualified name of the module owning it, attribute): the first
    module that registers it, as root.named_parameters() names it."""
    owners: dict[int, tuple[str, str]] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in owners:
                owners[id(p)] = (mod_name, attr)
    return owners


def check_requests(requests: Sequence[Request]) -> None:
    for r in requests:
        if not r.param.is_meta:
            raise ValueError(f"request for {r.name}: the parameter is not on the meta device")
        if not 0 <= r.start <= r.stop <= r.param.numel():
            raise ValueError(
                f"request for {r.name}: range [{r.start}, {r.stop}) is outside its "
                f"{r.param.numel()} elements"
            )
        if r.out.dim() != 1 or r.out.numel() != r.stop - r.start:
            raise ValueError(
                f"request for {r.name}: out has shape {tuple(r.out.shape)}, not "
                f"({r.stop - r.start},)"
            )


def parameter_like(param: nn.Parameter, data: Tensor) -> nn.Parameter:
    """A Parameter of `param`'s class and requires_grad holding `data`, with its Python
    attributes (a Hugging Face flag or two)."""
    new = torch.Tensor._make_subclass(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def swap_into(param: nn.Parameter, data: Tensor) -> None:
    """`param` holds `data` from now on; the same object, so ties and references hold."""
    torch.utils.swap_tensors(param, parameter_like(param, data.detach()))


def _values(param: nn.Parameter) -> Tensor:
    return param.detach()


def _nan(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    return t


def _has_nan(t: Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())


def qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
