"""A cp run's state and what it installs: torch's attention and cross-entropy swapped while the run is
active, position indices rewritten to the tokens' global positions, Hugging Face's causal-LM loss
given labels shifted across chunks, and the batch cut. See docs/context-parallel.md."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import comm
from .attention import SDPA, context_parallel_sdpa
from .chunks import chunk_ids, cut_batch, global_positions
from .state import active, set_active

CROSS_ENTROPY = F.cross_entropy


_FASTPATH = []  # nn.MultiheadAttention's fused fast path as it was before a cp run (it bypasses SDPA)


def activate(run: Optional["ContextParallel"]) -> None:
    """Make ``run`` the process's cp run (None: none): torch's functions are swapped only while one is."""
    set_active(run)
    if run is not None and not _FASTPATH:
        _FASTPATH.append(torch.backends.mha.get_fastpath_enabled())
        torch.backends.mha.set_fastpath_enabled(False)
    elif run is None and _FASTPATH:
        torch.backends.mha.set_fastpath_enabled(_FASTPATH.pop())
    F.scaled_dot_product_attention = context_parallel_sdpa if run is not None else SDPA
    F.cross_entropy = _cross_entropy if run is not None else CROSS_ENTROPY


class ContextParallel:
    """The cp group and ring neighbours of this rank, the attention mode, and the batch being trained
    (its whole sequence length); ``calls`` counts the attention calls made context-parallel."""

    def __init__(self, mesh, mode: str):
        self.cp, self.rank, self.group, self.mode = mesh.cp, mesh.cp_rank, mesh.cp_group, mode
        around = [mesh.global_rank(mesh.tp_rank, mesh.dp_rank, mesh.pp_rank, (self.rank + s) % self.cp) for s in (1, -1)]
        self.next, self.prev = around
        self.length: Optional[int] = None
        self.calls = 0
        self.current: Optional[str] = None  # the attention module running (named in errors)
        self.agreed: dict = {}  # per attention module: (causal, K/V heads sent), agreed over cp at its first call
        self._positions = {}

    def cut(self, batch):
        """This rank's two chunks of every sequence tensor of ``batch``."""
        batch, self.length = cut_batch(batch, self.cp, self.rank)
        self.calls = 0
        return batch

    def check_attention(self, step: str) -> None:
        """An error (on every rank alike) if ``step`` made no context-parallel attention call."""
        if self.calls == 0:
            raise ValueError(f"MegaStrategy(cp={self.cp}): {step} ran without a call to torch's "
                             f"scaled_dot_product_attention, so its attention saw only this rank's part of the sequence. "
                             f"Context parallelism needs attention through F.scaled_dot_product_attention (Hugging Face: "
                             f"attn_implementation='sdpa'; nn.MultiheadAttention with need_weights=False).")

    def done(self) -> None:
        """The batch's forward and backward are over: outside a step the model runs as torch's own."""
        self.length = None

    def positions(self, device) -> torch.Tensor:
        key = (self.length, device)
        if key not in self._positions:
            self._positions[key] = global_positions(self.length, self.cp, self.rank, device)
        return self._positions[key]

    def averaged(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` whose value is the mean over the cp ranks (what one process reports), gradient unchanged."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return loss
        mean = loss.detach().clone()
        comm.all_reduce(mean, self.group)
        return loss + (mean / self.cp - loss.detach())

    def install(self, module: nn.Module) -> None:
        """Position hooks, attention names and Hugging Face's loss on ``module`` (once)."""
        for name, sub in module.named_modules():
            if _positional(name, sub):
                sub.register_forward_pre_hook(_positions_hook(name), with_kwargs=True)
            if "attention" in type(sub).__name__.lower():
                sub.register_forward_pre_hook(_entering(name))
            if _causal_lm_loss(sub):
                sub._loss_function = _shifting_loss(sub.loss_function)


def _positional(name: str, module: nn.Module) -> bool:
    """A position table (an nn.Embedding whose name says so: wpe, pos, position...) or a rotary embedding."""
    leaf = name.rpartition(".")[2].lower()
    return (isinstance(module, nn.Embedding) and ("pos" in leaf or leaf == "wpe")) or \
        type(module).__name__.endswith("RotaryEmbedding")


def _entering(name: str):
    def hook(module, args):
        if active() is not None:
            active().current = f"{name} ({type(module).__name__})"
    return hook


def _positions_hook(name: str):
    def hook(module, args, kwargs):
        """The index a position table or rotary embedding is given: 0..n-1 plus an offset (the positions a model
        makes for its n local tokens) becomes this rank's global positions plus that offset; indices that are
        global already stay; anything else is refused (the same on every rank)."""
        run = active()
        if run is None or run.length is None:
            return None
        at = 0 if isinstance(module, nn.Embedding) else 1
        if kwargs.get("position_ids") is not None:
            return args, {**kwargs, "position_ids": _follow(run, kwargs["position_ids"], name, module)}
        if len(args) > at and isinstance(args[at], torch.Tensor):
            return args[:at] + (_follow(run, args[at], name, module),) + tuple(args[at + 1:]), kwargs
        return None
    return hook


def _follow(run, index: torch.Tensor, name: str, module) -> torch.Tensor:
    n = run.length // run.cp
    if not index.is_floating_point() and index.dim() > 0 and index.shape[-1] == n:
        positions = run.positions(index.device).to(index.dtype)
        offset = index[..., :1]
        if torch.equal(index - offset, torch.arange(n, device=index.device, dtype=index.dtype).expand_as(index)):
            return positions.expand_as(index) + offset
        if torch.equal(index - offset, (positions - positions[0]).expand_as(index)):
            return index  # this rank's global positions already (a batch's position_ids, cut)
    raise ValueError(f"MegaStrategy(cp={run.cp}): {name} ({type(module).__name__}) got position indices that are "
                     f"neither 0..{n - 1} (plus an offset) nor this rank's global positions, so context "
                     f"parallelism cannot give it the tokens' global positions. Pass position_ids 0..n-1 to the "
                     f"model (or in the batch), or use cp=1.")


def _causal_lm_loss(module: nn.Module) -> bool:
    """A Hugging Face causal LM whose loss is ForCausalLMLoss (which shifts the labels itself)."""
    if not hasattr(module, "config") or not type(module).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return False
    return getattr(getattr(module, "loss_function", None), "__name__", "") == "ForCausalLMLoss"


def _shifting_loss(loss_function):
    """Hugging Face's causal-LM loss shifts labels by one inside each rank's chunks; under cp the label
    after a chunk's last token lives in the next chunk: shift across chunks and pass ``shift_labels``."""

    def loss(logits, labels, vocab_size, *args, ignore_index: int = -100, shift_labels=None, **kwargs):
        run = active()
        if run is not None and run.length is not None and kwargs.get("num_items_in_batch") is not None:
            raise ValueError(f"MegaStrategy(cp={run.cp}): num_items_in_batch counts the whole batch's tokens, but each "
                             f"cp rank sums only its own: leave it None (the mean over the whole sequence's tokens is "
                             f"taken across the cp ranks).")
        if run is not None and run.length is not None and shift_labels is None and labels is not None:
            shift_labels = shifted_labels(run, labels, ignore_index)
        return loss_function(logits, labels, vocab_size, *args, ignore_index=ignore_index, shift_labels=shift_labels,
                             **kwargs)

    return loss


def shifted_labels(run: ContextParallel, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Each local token's next label in the whole sequence (``ignore_index`` after the last)."""
    c = labels.shape[1] // 2
    firsts = labels[:, [0, c]].contiguous()
    gathered = [torch.empty_like(firsts) for _ in range(run.cp)]
    dist.all_gather(gathered, firsts, group=run.group)
    first_of = {}
    for r, f in enumerate(gathered):
        for slot, chunk in enumerate(chunk_ids(run.cp, r)):
            first_of[chunk] = f[:, slot:slot + 1]
    end = torch.full_like(firsts[:, :1], ignore_index)
    parts = []
    for slot, chunk in enumerate(chunk_ids(run.cp, run.rank)):
        parts += [labels[:, slot * c + 1:(slot + 1) * c], first_of.get(chunk + 1, end)]
    return torch.cat(parts, dim=1)


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                   label_smoothing=0.0):
    """A mean over the tokens of the whole sequence, not of this rank's part: the sum here times cp over
    the cp group's count, so gradients averaged over cp equal one process's (padding included)."""
    run = active()
    plain = (run is None or run.length is None or reduction != "mean" or weight is not None or size_average is not None
             or reduce is not None or target.is_floating_point())
    if plain:
        return CROSS_ENTROPY(input, target, weight=weight, size_average=size_average, ignore_index=ignore_index,
                             reduce=reduce, reduction=reduction, label_smoothing=label_smoothing)
    n = run.length // run.cp
    if target.numel() % n and target.numel() % (n - 1) == 0:
        raise ValueError(f"MegaStrategy(cp={run.cp}): cross_entropy got {target.numel()} targets, a multiple of "
                         f"{n - 1}, not of the {n} tokens a cp rank holds: labels shifted inside the step "
                         f"(logits[:, :-1] against labels[:, 1:]) pair a chunk's last token with another chunk's "
                         f"first. Shift the labels in the data (targets = tokens[1:]) or pass labels to a Hugging "
                         f"Face model, which shifts them across chunks.")
    total = CROSS_ENTROPY(input, target, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing)
    count = (target != ignore_index).sum().to(total.dtype)
    count = comm.all_reduce(count, run.group)
    return total * run.cp / count
