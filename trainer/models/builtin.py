"""Small models to train with every mode (the loss and metric the trainer uses are in
loss.py, imported here too).

Each model keeps its repeated layers as separate submodules (a ModuleList of Linear
layers, of conv blocks, of transformer `Block`s) because FSDP shards the model unit by
unit: a unit is one such submodule, and a model made of one giant module could not show
the memory saving.

`activation_checkpointing=True` keeps only the input of each such layer or block during
forward and recomputes the rest in backward (`torch.utils.checkpoint`, non-reentrant):
activation memory falls from every intermediate tensor of every block to one tensor per
block, for about one extra forward of compute. Results are the same as without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trainer import comm
from trainer.errors import ConfigError
from trainer.models.loss import accuracy, loss_fn  # noqa: F401  (imported from here too)
from trainer.parallel.experts import dispatch_combine, expert_counts

GPT_TYPE = "shardtrain_gpt"  # config.json's model_type of our GPT (trainer/models/lm.py reads it)
GPT_MOE_TYPE = "shardtrain_gpt_moe"  # and of GPT-MoE

# --------------------------------------------------------------------------------------
# Activation checkpointing


def checkpointed(fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """`fn(*args)`, keeping only `args` for backward and recomputing the rest there.

    The recomputation runs `fn` again, module hooks included (fsdp recognises it, see
    fsdp.py's [Note: activation checkpointing]). A module's buffers, such as BatchNorm's
    running statistics, are restored after the recomputation so that they are updated
    once per forward, as without checkpointing. Without grad there is nothing to save:
    `fn` simply runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    buffers = list(fn.buffers()) if isinstance(fn, nn.Module) else []
    return checkpoint(
        fn, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), _restored(buffers))
    )


@contextmanager
def _restored(buffers: list[Tensor]) -> Iterator[None]:
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved, strict=True):
                b.copy_(v)


# --------------------------------------------------------------------------------------
# MLP: the default model, paired with trainer.data.datasets.synthetic_classification.


class MLP(nn.Module):
    """`depth` hidden Linear+ReLU layers and a Linear classification head. `loops` > 1
    runs the hidden layers after the first that many times (weight sharing across depth,
    as a looped model: each layer is called again after the others)."""

    def __init__(
        self,
        in_dim: int = 32,
        hidden: int = 128,
        depth: int = 3,
        num_classes: int = 10,
        activation_checkpointing: bool = False,
        loops: int = 1,
    ) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        if depth < 1:
            raise ConfigError(f"MLP depth {depth} must be at least 1")
        if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
            raise ConfigError(f"model.loops={loops!r} must be a whole number of at least 1")
        self.loops = loops
        dims = [in_dim] + [hidden] * depth
        # One Linear per entry so that FSDP can make each hidden layer its own unit.
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)  # (B, in_dim); also accepts (B, C, H, W) images
        x = self._hidden(self.layers, x)  # (B, hidden)
        for _ in range(self.loops - 1):  # the hidden-to-hidden layers again
            x = self._hidden(self.layers[1:], x)
        return self.head(x)  # (B, num_classes)

    def _hidden(self, layers: nn.ModuleList, x: Tensor) -> Tensor:
        if not self.activation_checkpointing:
            return _relu_layers(layers, x)
        # Segments of two layers, each keeping only its input. One Linear+ReLU keeps a
        # single activation anyway: checkpointing layer by layer would save nothing.
        for i in range(0, len(layers), 2):
            x = checkpointed(_relu_layers, layers[i : i + 2], x)
        return x


def _relu_layers(layers: nn.ModuleList, x: Tensor) -> Tensor:
    for layer in layers:
        x = F.relu(layer(x))
    return x


# --------------------------------------------------------------------------------------
# SmallCNN: conv blocks with BatchNorm, so the model has buffers (running stats) that
# every mode must keep in step across ranks.


class ConvBlock(nn.Module):
    """3x3 conv -> BatchNorm -> ReLU -> 2x2 max-pool: halves H and W."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        # No conv bias: BatchNorm's shift makes it redundant.
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)


class SmallCNN(nn.Module):
    """Two conv blocks, global average pooling, linear head.

    Global pooling makes the head independent of the image size, so the same model takes
    28x28 MNIST (in_channels=1) and 32x32 CIFAR-10 or synthetic images (in_channels=3).
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 16,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.blocks = nn.ModuleList([ConvBlock(in_channels, width), ConvBlock(width, 2 * width)])
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = checkpointed(block, x) if self.activation_checkpointing else block(x)
            # (B, C', H/2, W/2)
        x = x.mean(dim=(2, 3))  # (B, 2*width)
        return self.head(x)  # (B, num_classes)


# --------------------------------------------------------------------------------------
# GPT: a small nanoGPT-style decoder, paired with trainer.data.datasets.synthetic_tokens.

# [Note: documents kept apart]
# With `data.doc_mask=true` token data hands the model, besides the ids, each position's
# document within its window: `segments` (B, T) int64, 0 for the piece that began before
# the window, +1 at each document start (trainer/data/tokens.py). GPT then runs every
# document as if it were alone: a query attends the keys of its own document only, up to
# itself (`document_mask`: causal AND same document), and positions restart at 0 at each
# document's first token (the piece begun before the window starts at 0 too: the model
# never sees where a document began outside its window). So each document's logits are
# those of the model run on that document alone, up to the order of floating-point sums
# (tests/test_doc_mask.py): a masked key's weight is exp(-inf) = 0 exactly, and its value
# adds an exact 0. A document is a run of equal ids; `segments` None is plain causal
# attention over positions 0..T-1, unchanged. The mask is (B, 1, T, T) booleans, built once
# per forward and shared by every head and layer. A causal kernel skips the blocks above
# the diagonal, a masked one computes every block (and on CUDA a mask rules out the flash
# kernel), so a masked step costs more: scripts/benchmarks/bench_doc_mask.py measures it
# (docs/own_text.md, "Documents kept apart").


def document_mask(segments: Tensor) -> tuple[Tensor, Tensor]:
    """For `segments` (B, T) (the document of each position, a run of equal ids per
    document): position ids (B, T) that restart at 0 at each document's first token, and
    the attention mask (B, 1, T, T) bool, True where query t may attend key s: the same
    document and s <= t ([Note: documents kept apart])."""
    B, T = segments.shape
    t = torch.arange(T, device=segments.device)  # (T,)
    first = torch.ones_like(segments, dtype=torch.bool)  # (B, T) a document's first token
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = torch.where(first, t, 0).cummax(dim=1).values  # (B, T) where t's document starts
    keys = t.view(1, 1, T)
    mask = (keys >= start.unsqueeze(2)) & (keys <= t.view(1, T, 1))  # (B, T, T)
    return t - start, mask.unsqueeze(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool = True) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ConfigError(f"GPT n_embd {n_embd} is not divisible by n_head {n_head}")
        self.n_head = n_head
        # query, key, value in one matmul
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """`mask` (B, 1, T, T) bool, True where a query may attend a key (`document_mask`);
        None: every earlier position (plain causal attention)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): each head attends independently.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:  # a masked-out key gets exp(-inf) = 0 exactly: [Note: documents kept apart]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class FeedForward(nn.Module):
    """The transformer's position-wise MLP: expand 4x, GELU, project back."""

    def __init__(self, n_embd: int, bias: bool = True) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = FeedForward(n_embd, bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` Blocks, final LayerNorm, LM head.

    `tie_weights=True` makes lm_head.weight the very same Parameter as wte.weight (as in
    GPT-2). A tied model has fewer parameters than named modules suggest, which the
    sharding code must handle by deduplicating parameters (`model.parameters()` does).
    `bias=False` drops the biases of every Linear and LayerNorm (nanoGPT's default):
    with `tie_weights=True` it is nanoGPT's architecture, with half as many tensors for
    the optimizer to step (conf/model/nanogpt.yaml).
    """

    # forward(idx, segments) keeps documents apart ([Note: documents kept apart]): what
    # data.doc_mask=true needs of a model (trainer/config/checks.py asks for it)
    takes_documents = True

    def __init__(
        self,
        vocab_size: int = 64,
        block_size: int = 32,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        tie_weights: bool = False,
        activation_checkpointing: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.activation_checkpointing = activation_checkpointing
        self._sizes = dict(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
            n_embd=n_embd, tie_weights=tie_weights, bias=bias,
        )  # fmt: skip
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        # Every module first, then the residual projections again: the order of draws
        # from the RNG that this model has always used (init_module does both per module).
        self.apply(self._init_weights)
        for module in self.modules():
            self._scale_residual(module)

    def model_config(self) -> dict:
        """What trainer.models.lm.build_from_config rebuilds this model from (config.json)."""
        return {"model_type": GPT_TYPE, **self._sizes}

    def init_module(self, module: nn.Module) -> None:
        """Initialise the parameters `module` (one of this model's) owns itself, as the
        constructor does: trainer.models.materialize.SeededInit calls it module by module."""
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()  # ones and zeros, as its constructor left them
        self._init_weights(module)
        self._scale_residual(module)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _scale_residual(self, module: nn.Module) -> None:
        # GPT-2 scales the residual output projections by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth: every block's attention
        # projection, and the MLP's where the block has a dense one (GPT-MoE's experts
        # keep their own init).
        projections = [b.attn.c_proj for b in self.blocks]
        projections += [b.mlp.c_proj for b in self.blocks if isinstance(b, Block)]
        if any(module is c for c in projections):
            std = 0.02 / math.sqrt(2 * len(self.blocks))
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, idx: Tensor, segments: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab_size) of `idx` (B, T); `segments` (B, T): each position's
        document, kept apart from the others ([Note: documents kept apart])."""
        B, T = idx.shape
        if T > self.block_size:
            raise ConfigError(
                f"sequence length {T} is longer than GPT block_size {self.block_size}"
            )
        mask = None
        if segments is None:
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            pos, mask = document_mask(segments)  # (B, T), (B, 1, T, T)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C) + (T, C) or (B, T, C)
        for block in self.blocks:
            x = self._run_block(block, x, mask)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)

    def _run_block(self, block: nn.Module, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """One block's output (B, T, C), recomputed in backward with activation
        checkpointing. `mask`: document_mask's, or None (causal)."""
        args = (x,) if mask is None else (x, mask)  # a causal block is called as always
        return checkpointed(block, *args) if self.activation_checkpointing else block(*args)


# --------------------------------------------------------------------------------------
# GPT-MoE: the GPT above with a mixture-of-experts MLP in every k-th block.


class Experts(nn.Module):
    """`num_experts` GELU MLPs with their weights stacked over experts, (n, C, H) and
    (n, H, C), so that a rank's experts are a contiguous slice of rows (expert
    parallelism keeps rows [r*n/E, (r+1)*n/E), trainer/parallel/experts.py)."""

    def __init__(self, num_experts: int, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.empty(num_experts, n_embd, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, n_embd))
        self.placement = None  # set by expert parallelism: which experts live here
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, mean=0.0, std=0.02)
        nn.init.normal_(self.w_out, mean=0.0, std=0.02)

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows (N, C) grouped by the experts held here, counts[e] of them for expert e
        (zero too: every expert runs, so every one gets a gradient)."""
        out = [
            F.gelu(x @ self.w_in[e]) @ self.w_out[e]  # (counts[e], C)
            for e, x in enumerate(rows.split(counts))
        ]
        return torch.cat(out)  # (N, C)


# [Note: aux-loss-free load balancing]
# DeepSeek-V3's alternative to the load-balancing loss (arXiv 2412.19437, section 2.1.2),
# with `bias_update_speed` γ > 0: each MoE layer keeps a bias per expert, `expert_bias`
# (n,), added to the router's probabilities for the top-k choice only; the weights that
# combine the experts' outputs are the probabilities themselves. At every optimizer step
# (`update_expert_bias`, from GPTMoE.after_step after engine.step()) the rows routed to each
# expert since the last step are summed over all ranks (one AllReduce of n numbers per
# layer) and the bias moves by γ · sign(mean - count): up for an underloaded expert, down
# for an overloaded one. Every rank adds the same global counts to the same start (zeros),
# so the bias is the same on every rank and equal to what one process training on the
# whole batch computes. It is a persistent fp32 buffer: checkpoints keep it, and since an
# engine casts buffers to the compute dtype, the option asks for precision=fp32. The
# counts are taken in the real forward (GPTMoE._run_block), not in activation
# checkpointing's recomputation; a step skipped for a non-finite loss drops them.


class MoE(nn.Module):
    """Top-k softmax routing over `num_experts` Experts, with the Switch/GShard
    load-balancing loss: aux = n · Σ_i f_i · p_i, f_i the fraction of routed rows that
    go to expert i and p_i its mean router probability (1 when perfectly balanced).
    `bias_update_speed` > 0 adds DeepSeek-V3's bias to the choice ([Note: aux-loss-free
    load balancing])."""

    def __init__(
        self,
        n_embd: int,
        num_experts: int,
        top_k: int,
        hidden: int,
        bias_update_speed: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ConfigError(
                f"GPT-MoE top_k={top_k} must be between 1 and n_experts={num_experts}"
            )
        if not bias_update_speed >= 0:
            raise ConfigError(f"GPT-MoE bias_update_speed={bias_update_speed} must be >= 0")
        self.top_k = top_k
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = Experts(num_experts, n_embd, hidden)
        self.bias_update_speed = bias_update_speed
        if bias_update_speed:
            self.register_buffer("expert_bias", torch.zeros(num_experts))  # (n,) fp32
        self.routed: Tensor | None = None  # (n,) rows per expert in the latest forward
        self.pending: Tensor | None = None  # (n,) rows per expert since the bias update

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        probs = self.router(flat).float().softmax(dim=-1)  # (N, n) fp32 for the routing
        if self.bias_update_speed:  # the bias picks the experts, the probabilities weigh them
            top_idx = (probs.detach() + self.expert_bias.float()).topk(self.top_k, dim=-1)[1]
            top_w = probs.gather(1, top_idx)  # (N, k)
        else:
            top_w, top_idx = probs.topk(self.top_k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # the k weights sum to 1
        n = self.experts.num_experts
        y = dispatch_combine(flat, top_idx, top_w, self.experts, n, self.experts.placement)
        with torch.no_grad():
            self.routed = expert_counts(top_idx, n)  # (n,)
            routed = self.routed.float() / top_idx.numel()
        aux = n * (routed * probs.mean(dim=0)).sum()  # () fp32
        self.load = routed.detach()  # (n,) this forward's share of rows per expert
        return y.view(B, T, C).to(x.dtype), aux


class MoEBlock(nn.Module):
    """A Block whose MLP is an MoE; returns the block's output and the MoE's aux loss."""

    def __init__(
        self, n_embd: int, n_head: int, num_experts: int, top_k: int, bias_update_speed: float
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.moe = MoE(n_embd, num_experts, top_k, 4 * n_embd, bias_update_speed)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x = x + self.attn(self.ln_1(x), mask)  # (B, T, C)
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux  # (B, T, C), ()


class GPTMoE(GPT):
    """GPT with an MoE MLP in every `moe_every`-th block (the last of each group of
    `moe_every`: blocks moe_every-1, 2*moe_every-1, ...). The load-balancing losses of
    the MoE blocks, times `aux_loss_coef`, are summed into `aux_loss` at every forward;
    the training loop adds it to the loss (`extra_loss`, [Note: model hooks] in
    trainer/models/hooks.py). `bias_update_speed` > 0: DeepSeek-V3's aux-loss-free
    balancing besides ([Note: aux-loss-free load balancing]; `aux_loss_coef=0` leaves it
    alone), updated after every step (`after_step`)."""

    def __init__(
        self,
        vocab_size: int = 64,
        block_size: int = 32,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        tie_weights: bool = False,
        activation_checkpointing: bool = False,
        n_experts: int = 8,
        top_k: int = 2,
        moe_every: int = 1,
        aux_loss_coef: float = 0.01,
        bias_update_speed: float = 0.0,
    ) -> None:
        if moe_every < 1:
            raise ConfigError(f"GPT-MoE moe_every={moe_every} must be at least 1")
        self._moe = dict(n_experts=n_experts, top_k=top_k, moe_every=moe_every)
        if bias_update_speed:  # exports and checkpoints of models without it stay as they were
            self._moe["bias_update_speed"] = bias_update_speed
        super().__init__(
            vocab_size, block_size, n_layer, n_head, n_embd, tie_weights, activation_checkpointing
        )
        for i in range(moe_every - 1, n_layer, moe_every):
            self.blocks[i] = MoEBlock(n_embd, n_head, n_experts, top_k, bias_update_speed)
            for m in self.blocks[i].modules():
                self.init_module(m)
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: Tensor | None = None  # of the latest forward, times the coefficient

    def model_config(self) -> dict:
        return {
            **super().model_config(),
            "model_type": GPT_MOE_TYPE,
            **self._moe,
            "aux_loss_coef": self.aux_loss_coef,
        }

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, Experts):
            module.reset_parameters()
        super().init_module(module)

    def forward(self, idx: Tensor, segments: Tensor | None = None) -> Tensor:
        self._aux = torch.zeros((), device=idx.device)  # summed by _run_block
        logits = super().forward(idx, segments)  # (B, T, vocab_size)
        self.aux_loss = self.aux_loss_coef * self._aux
        return logits

    # What the training loop calls ([Note: model hooks] in trainer/models/hooks.py)

    def extra_loss(self) -> Tensor | None:
        """The latest forward's load-balancing loss, times its coefficient."""
        return self.aux_loss

    def after_step(self, stepped: bool | Tensor) -> None:
        """The routing bias's update, if the model has one (a collective)."""
        update_expert_bias(self, stepped)

    def figures(self) -> dict[str, Tensor]:
        """The latest aux loss and each MoE layer's share of rows per expert, on this rank
        (device values; TensorBoard gets their mean over ranks)."""
        out: dict[str, Tensor] = {}
        if self.aux_loss is not None:
            out["moe/aux_loss"] = self.aux_loss.detach()
        for i, load in enumerate(expert_loads(self)):
            out.update({f"moe/_load/{i}/{e}": v for e, v in enumerate(load)})
        return out

    def figures_to_log(self, means: dict[str, float]) -> dict[str, float]:
        """moe/aux_loss (mean over ranks) and moe/load_max_over_mean: the busiest expert's
        share of rows over the mean share (1: balanced), of the worst layer, each layer's
        load averaged over the ranks first."""
        out = {k: v for k, v in means.items() if not k.startswith("moe/_load/")}
        by_layer: dict[str, list[float]] = {}
        for k in sorted(k for k in means if k.startswith("moe/_load/")):
            by_layer.setdefault(k.rsplit("/", 1)[0], []).append(means[k])
        if by_layer:
            out["moe/load_max_over_mean"] = max(
                max(v) / (sum(v) / len(v)) for v in by_layer.values()
            )
        return out

    def _run_block(self, block: nn.Module, x: Tensor, mask: Tensor | None = None) -> Tensor:
        out = super()._run_block(block, x, mask)
        if isinstance(block, MoEBlock):  # (B, T, C) and its load-balancing loss ()
            out, aux = out
            self._aux = self._aux + aux
            moe = block.moe  # counted here, not in a checkpointed block's recomputation
            if moe.bias_update_speed and self.training and torch.is_grad_enabled():
                moe.pending = moe.routed if moe.pending is None else moe.pending + moe.routed
        return out  # (B, T, C)


def update_expert_bias(model: nn.Module, taken: bool | Tensor = True) -> None:
    """DeepSeek-V3's bias update of every MoE layer that has one, from the rows routed
    since the last update summed over all ranks ([Note: aux-loss-free load balancing]);
    a step not `taken` drops the counts (a device flag: the update is multiplied by it, no
    host read). Call it on every rank after each optimizer step: it is a collective."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.bias_update_speed]
    if not layers:
        return
    pending = [m.pending for m in layers]
    for m in layers:
        m.pending = None
    if taken is False:
        return
    counts = torch.stack(  # (layers, n): whole numbers, exact in fp64
        [
            (torch.zeros_like(m.expert_bias) if c is None else c).double()
            for m, c in zip(layers, pending, strict=True)
        ]
    )
    if torch.distributed.is_initialized() and comm.world_size() > 1:
        comm.all_reduce(counts, tag="moe.bias_counts", account=False).wait()
    with torch.no_grad():
        for m, c in zip(layers, counts, strict=True):
            step = torch.sign(c.mean() - c).to(m.expert_bias.dtype)  # (n,) +1 underloaded
            if isinstance(taken, Tensor):
                step = step * taken.to(step.device, step.dtype)
            m.expert_bias.add_(step, alpha=m.bias_update_speed)


def expert_loads(model: nn.Module) -> list[Tensor]:
    """Each MoE layer's share of routed rows per expert (n,) in the latest forward, on
    this rank: GPT-MoE's; [] for other models."""
    return [m.load for m in model.modules() if isinstance(m, MoE) and hasattr(m, "load")]


# --------------------------------------------------------------------------------------
# torchvision


def resnet18(num_classes: int = 10, activation_checkpointing: bool = False) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised (no pretrained weights, no download).

    With activation checkpointing each residual block of layer1..layer4 is checkpointed;
    the state_dict keys stay torchvision's."""
    import torchvision  # here, not at the top: it imports torch._dynamo (trainer/data/datasets.py)

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if activation_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, _CheckpointedSequential(*getattr(model, name)))
    return model


class _CheckpointedSequential(nn.Sequential):
    """nn.Sequential whose children each run under `checkpointed`."""

    def forward(self, x: Tensor) -> Tensor:
        for block in self:
            x = checkpointed(block, x)
        return x
