"""What a plan needs to know of a model, read once from the module (meta tensors are enough): its blocks,
their parameters and FLOPs per token, and explain's exact activation bytes per block for each tp layout.
See docs/planner.md."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

from torch import nn

from ..explain.estimate import explain
from ..experts.families import find_moe_blocks
from ..explain.costs import heads_of
from ..layers.linear import is_conv1d
from ..plans import lookup
from .estimate import PRECISIONS

@dataclass
class ModelProfile:
    """Per block (all alike) and outside the blocks: parameters, forward FLOPs per token (the attention core's
    apart), and ``act[(tp, sp, recompute)]`` = (kept per block, kept outside, one block's recompute) bytes per
    sequence of ``seq`` tokens at the precision's activation bytes."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    block_params: int
    outer_params: int
    block_flops: float
    core_flops: float
    outer_flops: float
    precision: str = "megatron"  # see .estimate.PRECISIONS
    act: dict = field(default_factory=dict)
    params_at: dict = field(default_factory=dict)  # tp -> (per block, outside) on one tp rank
    experts: int = 0  # the fewest experts of a mixture-of-experts layer (0: none); ep divides it
    expert_params_at: dict = field(default_factory=dict)  # tp -> one block's expert parameters on a tp rank
    a2a: tuple = (0, 0)  # per block, under ep: (all-to-alls, elements per token of each): k rows out and back
    tp_outer: dict = field(default_factory=dict)  # (tp, sp) -> tp collectives outside the blocks, in blocks' worth
    timed: dict = field(default_factory=dict)  # (tp, recompute, microbatch size) -> seconds (see .timing)
    refused: dict = field(default_factory=dict)  # tp -> why the strategy refuses it for this model

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.outer_params

    def tps(self, most: int) -> list:
        """tp sizes this model splits into (dividing its heads, not refused), up to ``most``."""
        return [t for t in range(1, most + 1) if self.heads % t == 0 and self.hidden % t == 0 and t not in self.refused]


def _linear_flops(module: nn.Module) -> float:
    """Forward FLOPs per token of the matrix products of ``module``'s Linear (and Hugging Face Conv1D) layers."""
    total = 0.0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            total += 2 * m.in_features * m.out_features
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            total += 2 * m.weight.shape[0] * m.weight.shape[1]
    return total


def _in_features(module: nn.Module) -> int:
    """The input size of a Linear, or of a Hugging Face Conv1D (its weight is in x out); 0 for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features
    return module.weight.shape[0] if is_conv1d(module) else 0


def _heads(block: nn.Module) -> int:
    found = next((n for m in block.modules() for n in [heads_of(m, 0)] if n), 0)
    if found:
        return found
    raise ValueError(f"plan(): found no attention head count in {type(block).__name__} (num_heads, n_head, "
                     f"num_attention_heads).")


@contextlib.contextmanager
def first_blocks(module: nn.Module, path: str, n: int):
    """``module`` with its block list at ``path`` cut to the first ``n`` blocks, for the ``with`` body."""
    blocks = module.get_submodule(path)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"plan(): the blocks at {path} are a {type(blocks).__name__}; an nn.ModuleList or "
                         f"nn.Sequential is needed.")
    module.set_submodule(path, type(blocks)(list(blocks)[:n]))
    try:
        yield module
    finally:
        module.set_submodule(path, blocks)


def profile(module: nn.Module, seq: int, tps, flash: bool = True, plan="auto",
            precision: str = "megatron") -> ModelProfile:
    """Read ``module`` (its blocks from its plan) for sequences of ``seq`` tokens; activation bytes for
    each tp in ``tps`` dividing its heads (and sp, recompute none/selective/full) from explain on 2 and 3 blocks."""
    path = lookup.blocks_path(module, plan)
    blocks = module.get_submodule(path)
    if len(blocks) < 3:
        raise ValueError(f"plan(): {path} holds {len(blocks)} blocks; a plan needs at least 3.")
    block = blocks[0]
    in_blocks = {id(p) for p in blocks.parameters()}
    outer = {id(p): p for p in module.parameters() if id(p) not in in_blocks}
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    vocab = max((m.num_embeddings for m in embeddings), default=0)
    hidden = next((n for m in block.modules() for n in [_in_features(m)] if n), 0)
    if not hidden:
        raise ValueError(f"plan(): {path}.0 ({type(block).__name__}) holds no Linear or Conv1D layer to read the "
                         f"hidden size from.")
    moe = find_moe_blocks(block, lookup.expert_styles(plan))
    # a token runs k of a layer's E experts: their products count k / E of all the experts' FLOPs
    unrouted = sum(_linear_flops(b.experts) * (1 - f.top_k(b) / f.num_experts(b)) for _, b, f in moe)
    out = ModelProfile(layers=len(blocks), hidden=hidden, heads=_heads(block), vocab=vocab, seq=seq,
                       block_params=sum(p.numel() for p in block.parameters()),
                       outer_params=sum(p.numel() for p in outer.values()),
                       block_flops=_linear_flops(block) - unrouted + 4 * seq * hidden, core_flops=4 * seq * hidden,
                       outer_flops=_linear_flops(module) - len(blocks) * _linear_flops(block), precision=precision,
                       experts=min((f.num_experts(b) for _, b, f in moe), default=0),
                       a2a=(4 * len(moe), max((f.top_k(b) * b.gate.in_features for _, b, f in moe), default=0)))
    with warnings.catch_warnings(record=True) as said:  # the plan's warnings, once per model (not per layout)
        warnings.simplefilter("always")
        for t in out.tps(max(tps)):
            if t not in tps:
                continue
            try:
                _read_layouts(out, module, path, t, flash, plan)
            except ValueError as e:
                if t == 1:
                    raise
                out.refused[t] = str(e)  # the strategy refuses this tp: plan the other axes without it
    for message in dict.fromkeys((str(w.message), w.category) for w in said):
        warnings.warn(message[0], message[1], stacklevel=3)
    return out


def _read_layouts(out: ModelProfile, module: nn.Module, path: str, t: int, flash: bool, plan) -> None:
    """Fill ``out``'s activation, parameter and tp-collective figures at tp = ``t`` (sp, recompute) from explain
    on the first 2 and 3 blocks; a ValueError where the strategy refuses this tp."""
    act_bytes = PRECISIONS[out.precision][0]
    copies = 0 if flash else 3  # s x s tensors an attention core keeps per head (explain's score_copies)
    for sp in ((False, True) if t > 1 else (False,)):
        for mode in (False, "selective", True):
            kept, transient, params, tp_bytes, experts = [], 0, [], [], []
            for n in (2, 3):
                with first_blocks(module, path, n):
                    r = explain(module, tp=t, sp=sp, batch_shape=(1, out.seq), dtype_bytes=act_bytes,
                                grad_bytes=act_bytes, activation_checkpointing=mode, score_copies=copies, plan=plan,
                                print_report=False, ranks=((0, 0),)).rank(0)
                kept.append(r.act_bytes - r.recompute_bytes)
                transient, params, tp_bytes = r.recompute_bytes, params + [r.params], tp_bytes + [r.tp_bytes]
                experts.append(r.expert_params)
            per_block = kept[1] - kept[0]
            out.act[(t, sp, mode)] = (per_block, kept[0] - 2 * per_block, transient)
            if not mode and t > 1:  # the embedding's and the head's collectives, in blocks' worth
                block_tp = tp_bytes[1] - tp_bytes[0]
                out.tp_outer[(t, sp)] = (tp_bytes[0] - 2 * block_tp) / block_tp if block_tp else 0.0
            out.params_at[t] = (params[1] - params[0], params[0] - 2 * (params[1] - params[0]))
            out.expert_params_at[t] = experts[1] - experts[0]
