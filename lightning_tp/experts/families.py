"""How each supported mixture-of-experts block routes its tokens, found by the block's class name:
the router's rule (softmax then top-k, or top-k then softmax), and whether a gated shared expert and
the router logits come with the output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .blocks.fused import is_fused_experts, router_of


def softmax_then_topk(k: int, normalize: bool):
    """Hugging Face's rule (Mixtral, Qwen2-MoE, OLMoE): softmax in fp32, top-k, optionally renormalized."""
    def route(logits: torch.Tensor, dtype):
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, idx = torch.topk(weights, k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), idx
    return route


def topk_then_softmax(k: int):
    """litgpt's rule (LLaMAMoE): top-k of the logits, softmax over those k."""
    def route(logits: torch.Tensor, dtype):
        top, idx = torch.topk(logits, k)
        return top.softmax(dim=1, dtype=torch.float).to(dtype=dtype), idx
    return route


def topk_then_sigmoid(k: int):
    """Llama 4's rule: top-k of the logits, the sigmoid of each (it scales the expert's input, not its output)."""
    def route(logits: torch.Tensor, dtype):
        top, idx = torch.topk(logits, k, dim=1)
        return torch.sigmoid(top.float()).to(dtype), idx
    return route


@dataclass(frozen=True)
class MoEFamily:
    """One block class: its expert count, top-k and routing rule read from an instance."""

    name: str
    num_experts: Callable[[nn.Module], int]
    top_k: Callable[[nn.Module], int]
    route: Callable[[nn.Module], Callable]
    returns_logits: bool = True  # the block returns (hidden states, router logits)
    shared_expert: bool = False  # Qwen2-MoE: + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    jitter: bool = False  # Mixtral: multiplicative router jitter while training
    fused: bool = False  # transformers 5.x: the model's router stays, its ``experts`` module is distributed
    calls_idle: bool = True  # its loop calls an expert no token chose (a zero gradient); False: skipped (no gradient)


FAMILIES = {
    "MixtralSparseMoeBlock": MoEFamily(
        "hf_mixtral", lambda m: m.num_experts, lambda m: m.top_k,
        lambda m: softmax_then_topk(m.top_k, True), jitter=True, calls_idle=False),
    "Qwen2MoeSparseMoeBlock": MoEFamily(
        "hf_qwen2_moe", lambda m: m.num_experts, lambda m: m.top_k,
        lambda m: softmax_then_topk(m.top_k, m.norm_topk_prob), shared_expert=True, calls_idle=False),
    "Qwen3MoeSparseMoeBlock": MoEFamily(
        "hf_qwen3_moe", lambda m: m.num_experts, lambda m: m.top_k,
        lambda m: softmax_then_topk(m.top_k, m.norm_topk_prob), calls_idle=False),
    "OlmoeSparseMoeBlock": MoEFamily(
        "hf_olmoe", lambda m: m.num_experts, lambda m: m.top_k,
        lambda m: softmax_then_topk(m.top_k, m.norm_topk_prob)),
    "examples.gpt.model.MoE": MoEFamily(
        "example_gpt_moe", lambda m: m.num_experts, lambda m: m.top_k,
        lambda m: softmax_then_topk(m.top_k, True), returns_logits=False),
    "LLaMAMoE": MoEFamily(
        "litgpt_moe", lambda m: m.config.n_expert, lambda m: m.config.n_expert_per_token,
        lambda m: topk_then_softmax(m.config.n_expert_per_token), returns_logits=False),
}

# Llama 4: a router returning (scores, logits), a shared expert, experts in 3-D weights; runs as experts/blocks/llama4.py says
LLAMA4 = MoEFamily("hf_llama4", lambda m: m.num_experts, lambda m: m.top_k, lambda m: topk_then_sigmoid(m.top_k))
FAMILIES["Llama4TextMoe"] = LLAMA4

# Switch Transformers: top-1, the router's own capacity per sequence; the block runs as experts/blocks/switch.py says
SWITCH = MoEFamily("hf_switch", lambda m: m.router.num_experts, lambda m: 1, lambda m: None, returns_logits=False,
                   calls_idle=False)
FAMILIES["SwitchTransformersSparseMLP"] = SWITCH


def declared_family(options: dict) -> MoEFamily:
    """The family of a block a user plan styles 'experts' (see plans/base.py's STYLE_OPTIONS)."""
    k = options["top_k"]
    top_k = (lambda m: k) if isinstance(k, int) else (lambda m: getattr(m, k))
    normalize, router = options.get("normalize", True), options.get("router", "softmax_topk")
    route = (lambda m: softmax_then_topk(top_k(m), normalize)) if router == "softmax_topk" else \
        (lambda m: topk_then_softmax(top_k(m)))
    num = options.get("num_experts")
    return MoEFamily("plan_experts", (lambda m: num) if num else (lambda m: len(m.experts)), top_k, route,
                     returns_logits=bool(options.get("returns_logits", False)))


def check_block(path: str, block: nn.Module, family: MoEFamily, ep: int) -> None:
    """A clear error where ``ep`` cannot split ``block``: top_k above its experts, or ep not dividing them."""
    experts, k = family.num_experts(block), family.top_k(block)
    if k > experts:
        raise ValueError(f"{path} ({type(block).__name__}) routes each token to top_k={k} of {experts} experts: "
                         f"top_k must not exceed the number of experts.")
    if experts % ep:
        raise ValueError(f"MegaStrategy(ep={ep}): {path} ({type(block).__name__}) has {experts} experts, which "
                         f"ep={ep} does not divide; choose an ep that divides {experts}.")


def _fused_count(block: nn.Module) -> int:
    ep = getattr(block.experts, "_lightning_tp_ep", None)  # already expert-parallel: its local count is less
    return ep["experts"] if ep else block.experts.num_experts


def _fused_top_k(block: nn.Module) -> int:
    router, config = router_of(block), getattr(block.experts, "config", None)
    k = getattr(router, "top_k", None) or getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int):
        raise ValueError(f"{type(block).__name__}: cannot read how many experts a token takes (no top_k on its router, "
                         f"no num_experts_per_tok in its config); declare the block with the plan style 'experts'.")
    return k


FUSED = MoEFamily("hf_fused_experts", _fused_count, _fused_top_k, lambda m: None, returns_logits=False, fused=True)


def family_of(module: nn.Module):
    """The :class:`MoEFamily` of a block, by its qualified class name or else its class name; a transformers
    5.x block (a router beside a fused ``experts`` module) whatever its class; None if unknown."""
    experts = getattr(module, "experts", None)
    if is_fused_experts(experts) and router_of(module) is not None:
        return FUSED
    if experts is not None and is_fused_experts(experts):
        return None
    kind = type(module)
    return FAMILIES.get(f"{kind.__module__}.{kind.__qualname__}") or FAMILIES.get(kind.__name__)


def find_moe_blocks(model: nn.Module, declared=()) -> list:
    """(path, block, family) of every mixture-of-experts block of a known family, or at a path a user plan
    styles 'experts' (``declared``: (glob, options) pairs), outermost first."""
    from ..plans.base import path_matches

    found = []
    for name, m in model.named_modules():
        options = next((o for glob, o in declared if path_matches(glob, name)), None)
        family = declared_family(options) if options is not None else family_of(m)
        if family is not None:
            found.append((name, m, family))
    return found
