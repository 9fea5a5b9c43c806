"""A cp run's state and what it installs: torch's attention and cross-entropy swapped while the run is
active, position indices rewritten to the tokens' global positions, Hugging Face's causal-LM loss
given labels shifted across chunks, and the batch cut. See docs/context-parallel.md."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import SDPA, context_parallel_sdpa
from .chunks import chunk_ids, cut_batch, global_positions
from .state import active, set_active

CROSS_ENTROPY = F.cross_entropy


def activate(run: Optional["ContextParallel"]) -> None:
    """Make ``run`` the process's cp run (None: none): torch's functions are swapped only while one is."""
    set_active(run)
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
        self.readings: dict = {}  # this batch's masks read as causal (True) or none (False), see .attention
        self.agreed = False  # whether this batch's first reading was agreed over the cp group
        self.device = None
        self.kv_heads = 0  # the most key/value heads any cp rank passed on this batch's first call
        self._positions = {}

    def cut(self, batch):
        """This rank's two chunks of every sequence tensor of ``batch``."""
        batch, self.length = cut_batch(batch, self.cp, self.rank)
        self.readings, self.agreed = {}, False
        return batch

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
        dist.all_reduce(mean, group=self.group)
        return loss + (mean / self.cp - loss.detach())

    def install(self, module: nn.Module) -> None:
        """Position hooks, attention names and Hugging Face's loss on ``module`` (once)."""
        for name, sub in module.named_modules():
            if _positional(name, sub):
                sub.register_forward_pre_hook(_global_positions, with_kwargs=True)
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


def _global_positions(module, args, kwargs):
    """An index tensor equal to 0..n-1 (the positions a model makes for its n local tokens) becomes the
    global positions of this rank's tokens: position embeddings and rotary tables see the whole sequence."""
    run = active()
    if run is None or run.length is None:
        return None
    n = run.length // run.cp
    if isinstance(module, nn.Embedding):
        if args and _local_arange(args[0], n):
            return (run.positions(args[0].device).to(args[0].dtype).expand_as(args[0]),) + tuple(args[1:]), kwargs
        return None
    if "position_ids" in kwargs and _local_arange(kwargs["position_ids"], n):
        p = kwargs["position_ids"]
        return args, {**kwargs, "position_ids": run.positions(p.device).to(p.dtype).expand_as(p)}
    if len(args) > 1 and _local_arange(args[1], n):
        p = args[1]
        return (args[0], run.positions(p.device).to(p.dtype).expand_as(p)) + tuple(args[2:]), kwargs
    return None


def _local_arange(t, n: int) -> bool:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dim() == 0 or t.shape[-1] != n:
        return False
    return bool(torch.equal(t, torch.arange(n, device=t.device, dtype=t.dtype).expand_as(t)))


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
    total = CROSS_ENTROPY(input, target, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing)
    count = (target != ignore_index).sum().to(total.dtype)
    dist.all_reduce(count, group=run.group)
    return total * run.cp / count
