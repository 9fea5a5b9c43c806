"""Tokens per expert, made visible: :class:`ExpertLoad` counts what every mixture-of-experts layer's router
chose, logs each layer's imbalance (and tokens dropped under a capacity), draws a layer x expert heat map,
and can balance DeepSeek-V3-style routers without an auxiliary loss. See docs/experts.md."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from .. import comm
from .dispatch import capacity_of
from .families import SWITCH, family_of
from .blocks.fused import router_of
from .blocks.layer import ExpertParallelMoE


def moe_layers(model: nn.Module) -> list:
    """(path, block, family) of every MoE block of ``model`` (expert-parallel ones included), in module order."""
    found = []
    for path, m in model.named_modules():
        family = m.family if isinstance(m, ExpertParallelMoE) else family_of(m)
        if family is not None:
            found.append((path, m, family))
    return found


def _in_backward() -> bool:
    """A recomputation inside the backward (activation checkpointing) runs the router again: not counted."""
    return torch._C._current_graph_task_id() != -1


class ExpertLoad(Callback):
    """Logs each MoE layer's tokens-per-expert ``max/mean`` (and dropped share) every ``every_n_steps``; draws
    a layer x expert ``heatmap`` PNG; ``bias_rate``: DeepSeek-V3's aux-loss-free update of a router's
    ``e_score_correction_bias`` after each step (docs/experts.md)."""

    def __init__(self, every_n_steps: int = 50, heatmap=None, bias_rate: float = 0.0):
        self.every_n_steps, self.heatmap, self.bias_rate = every_n_steps, heatmap, bias_rate
        self.layers, self.history = [], []  # history: per logged step, the [layers, experts] global counts

    def on_train_start(self, trainer, pl_module) -> None:
        here = [(path, block, family) for path, block, family in moe_layers(pl_module)
                if not any(p.is_meta for p in block.parameters())]
        shapes = [(path, family.num_experts(block)) for path, block, family in here]
        if dist.is_available() and dist.is_initialized():  # a pipeline stage holds some layers: rows for all
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, shapes)
            shapes = sorted({s for rank in every for s in rank}, key=lambda s: _order(s[0]))
        if not shapes:
            raise ValueError(f"ExpertLoad: {type(pl_module).__name__} has no mixture-of-experts layer this project "
                             f"knows (see docs/experts.md).")
        mine = {path: (block, family) for path, block, family in here}
        self.layers = [(path, *mine.get(path, (None, None))) for path, _ in shapes]
        self.widths = [e for _, e in shapes]
        self.step = torch.zeros(len(shapes), max(self.widths) + 1, dtype=torch.float64)  # last column: dropped pairs
        self.window = torch.zeros_like(self.step)
        self.total = torch.zeros_like(self.step)
        mesh = getattr(trainer.strategy, "mesh", None)
        counts_here = mesh is None or mesh.tp_rank == 0 or _on_shards(self.layers)  # tp ranks share tokens unless sp
        for i, (_, block, family) in enumerate(self.layers):
            if block is None or not counts_here:
                continue  # another pipeline stage's layer, or a tp rank seeing the same tokens as rank 0
            if family.fused:
                block.experts.register_forward_pre_hook(self._fused_hook(i, block, family))
            elif family is SWITCH:  # its router's own capacity decides what each expert takes
                block.router.register_forward_hook(self._switch_hook(i))
            else:  # a router Linear (gate), or Llama 4's returning (scores, logits)
                router_of(block).register_forward_hook(self._gate_hook(i, block, family))

    def _add(self, i: int, idx: torch.Tensor, experts: int, capacity, fold=None, alike=None) -> None:
        if _in_backward():
            return
        if alike is not None:  # etp on sequence shards: the tp ranks dispatch their gathered tokens; the first counts
            idx = comm.all_gather(idx, 0, alike)
            if comm.group_rank(alike) > 0:
                return
        counts = torch.bincount(idx.reshape(-1), minlength=experts).to(torch.float64).cpu()
        self.step[i, :experts] += counts
        if capacity is not None:  # a capacity counts each dispatching rank's rows (an ep group's tp ranks: a share)
            k = idx.shape[-1]
            for part in idx.reshape(-1, k).tensor_split(comm.group_size(fold)):
                held = torch.bincount(part.reshape(-1), minlength=experts).to(torch.float64).cpu()
                self.step[i, -1] += (held - capacity_of(capacity, part.shape[0], k, experts)).clamp(min=0).sum()

    def _fused_hook(self, i, block, family):
        def hook(module, args):
            ep = getattr(module, "_lightning_tp_ep", None)
            self._add(i, args[1], family.num_experts(block), ep["capacity"] if ep else None, ep and ep["fold"],
                      ep["etp"] if ep and ep["sp"] else None)
        return hook

    def _switch_hook(self, i):
        def hook(module, args, out):
            if _in_backward():
                return
            mask = out[0].reshape(-1, out[0].shape[-1])  # one-hot, zero where over its expert's capacity
            self.step[i, :mask.shape[-1]] += mask.sum(0).to(torch.float64).cpu()
            self.step[i, -1] += float((mask.sum(-1) == 0).sum())
        return hook

    def _gate_hook(self, i, block, family):
        route = block._route if isinstance(block, ExpertParallelMoE) else family.route(block)

        def hook(module, args, logits):
            logits = logits[-1] if isinstance(logits, tuple) else logits
            _, idx = route(logits, logits.dtype)
            sp = getattr(block, "sp_group", None) is not None
            self._add(i, idx, family.num_experts(block), getattr(block, "capacity_factor", None),
                      getattr(block, "fold_group", None), getattr(block, "etp_group", None) if sp else None)
        return hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == getattr(self, "_last", -1):  # a batch accumulated towards the next optimizer step
            return
        self._last = step
        log_now = step % self.every_n_steps == 0
        if self.bias_rate or log_now:  # one all-reduce of every layer's counts, on every rank alike
            counts = self.step.clone()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(counts)
            self.window += counts
            self.total += counts
            self.step.zero_()
            if self.bias_rate:
                self._balance(counts)
        if log_now:
            self._log(pl_module, step)

    def _balance(self, counts: torch.Tensor) -> None:
        for i, (_, block, family) in enumerate(self.layers):
            bias = getattr(getattr(block, "gate", None), "e_score_correction_bias", None)
            if bias is None:
                continue
            load = counts[i, :self.widths[i]]
            with torch.no_grad():
                bias += self.bias_rate * torch.sign(load.mean() - load).to(bias)

    def _log(self, pl_module, step: int) -> None:
        self.history.append((step, self.window.clone()))
        for i, (path, _, _) in enumerate(self.layers):
            load = self.window[i, :self.widths[i]]
            if load.sum() == 0:
                continue
            pl_module.log(f"expert_load/{path}/max_over_mean", (load.max() / load.mean()).item(), on_step=True)
            if self.window[i, -1] > 0:
                pl_module.log(f"expert_load/{path}/dropped", (self.window[i, -1] / load.sum()).item(), on_step=True)
        self.window.zero_()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.heatmap and trainer.is_global_zero and self.layers:
            draw_heatmap(self.total[:, :-1], self.heatmap)


def _on_shards(layers: list) -> bool:
    """Whether the MoE blocks run on sequence shards (sp): each tp rank then routes its own tokens."""
    from ..marks import marks_of

    for _, block, _ in layers:
        if block is None:
            continue
        if isinstance(block, ExpertParallelMoE):  # Switch Transformers' routes whole sequences even under sp
            return block.sp_group is not None and block.family is not SWITCH
        ep = getattr(getattr(block, "experts", None), "_lightning_tp_ep", None)
        if ep is not None:
            return ep["sp"]
        return any(marks_of(p).sp_partial for p in block.parameters())  # a block left whole: partial under sp only
    return False


def _order(path: str) -> tuple:
    """A module path's place in module order (layer indices compared as numbers, an encoder before the rest)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, part != "encoder", part) for part in path.split("."))


def draw_heatmap(counts: torch.Tensor, path, cell: int = 24) -> None:
    """``counts`` [layers, experts] as a PNG: one row per layer, darker where an expert took more of its tokens."""
    from ..layout_search.picture import write_png

    rows, cols = counts.shape
    share = counts / counts.sum(1, keepdim=True).clamp(min=1)
    top = share.max().clamp(min=1e-12)
    width, height = cols * cell, rows * cell
    pixels = bytearray(width * height * 3)
    for r in range(rows):
        for c in range(cols):
            shade = int(255 * (1 - share[r, c] / top))
            color = bytes((shade, shade, 255))
            for y in range(r * cell, (r + 1) * cell - 1):
                at = (y * width + c * cell) * 3
                pixels[at:at + (cell - 1) * 3] = color * (cell - 1)
    write_png(path, width, height, pixels)
