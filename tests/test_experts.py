"""Expert-parallel token dispatch against one process: dispatch, experts, combine."""

import pytest
import torch
import torch.distributed as torch_dist

import dist
from lightning_tp import comm
from lightning_tp.experts.dispatch import combine, dispatch
from models import installed

E, K, H = 4, 2, 6


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, H, generator=g, dtype=torch.float64) for _ in range(E)]


def _tokens(rank, n=7):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _moe(x, idx, w, weights, group, first):
    """Run the experts held here (global ids first..first+len(weights)-1) on the dispatched rows."""
    rows, per_expert, d = dispatch(x, idx, E, group)
    outs = [chunk @ weights[first + e] for e, chunk in enumerate(rows.split(per_expert))]
    y = torch.cat(outs) if outs else rows
    return combine(y, w, d, group)


def _reference(x, idx, w, weights):
    """Mixtral's loop: each expert on its tokens, weighted, summed per token."""
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        out.index_add_(0, tok, (x[tok] @ weights[e]) * w[tok, slot, None])
    return out


def _grid(tp, dp, ep, etp, pp=1):
    """Every rank's (ep group, expert-dp group) as _expert_groups makes them (groups recorded as rank tuples)."""
    from lightning_tp.mesh import ParallelMesh, _expert_groups

    out = []
    for rank in range(tp * dp * pp):
        mesh = ParallelMesh(tp=tp, dp=dp, pp=pp, ep=ep, etp=etp, rank=rank)
        mesh.new_group = lambda ranks=None, backend=None: tuple(ranks)
        _expert_groups(mesh)
        # each rank's place in its groups, as ZeRO-1's expert buckets and the dispatch read it
        assert mesh.ep_group[mesh.ep_rank] == rank and mesh.edp_group[mesh.edp_rank] == rank, (rank, mesh)
        out.append((mesh.ep_group, mesh.edp_group))
    return out


def test_the_expert_grid_folds_ep_over_tp_and_with_etp_puts_ep_groups_tp_apart():
    # etp=1: ep groups are consecutive ranks (tp first), expert-dp every ep-th rank
    assert _grid(tp=2, dp=4, ep=2, etp=1)[:3] == [((0, 1), (0, 2, 4, 6)), ((0, 1), (1, 3, 5, 7)),
                                                   ((2, 3), (0, 2, 4, 6))]
    # etp=tp=2: an ep group holds one tp rank of ep dp ranks; expert-dp: the same tp rank and experts
    assert _grid(tp=2, dp=8, ep=2, etp=2)[5] == ((5, 7), (1, 5, 9, 13))  # etp x ep x edp = 2 x 2 x 4
    grid = _grid(tp=2, dp=4, ep=2, etp=2)
    assert grid[:6] == [((0, 2), (0, 4)), ((1, 3), (1, 5)), ((0, 2), (2, 6)), ((1, 3), (3, 7)),
                        ((4, 6), (0, 4)), ((5, 7), (1, 5))]
    # ep=1 with etp=tp: no ep group beyond the rank itself; its slices are averaged over dp at its tp rank
    assert _grid(tp=2, dp=2, ep=1, etp=2) == [((0,), (0, 2)), ((1,), (1, 3)), ((2,), (0, 2)), ((3,), (1, 3))]
    # a second stage's groups are its own ranks
    assert _grid(tp=2, dp=2, ep=2, etp=2, pp=2)[4:] == [((4, 6), (4,)), ((5, 7), (5,)), ((4, 6), (6,)), ((5, 7), (7,))]
    # etp=2 below tp=4: an ep group takes one slice of the tp group's other half; tp=8: two copies in a tp group
    assert _grid(tp=4, dp=1, ep=2, etp=2) == [((0, 2), (0,)), ((1, 3), (1,)), ((0, 2), (2,)), ((1, 3), (3,))]
    assert _grid(tp=8, dp=1, ep=2, etp=2)[5] == ((5, 7), (1, 5))


def _tp_cuts(tp, dp, etp, ep=2):
    """Every rank's (etp group, fold group) as _tp_subgroups makes them (groups recorded as rank tuples)."""
    from lightning_tp.mesh import ParallelMesh, _tp_subgroups

    out = []
    for rank in range(tp * dp):
        mesh = ParallelMesh(tp=tp, dp=dp, ep=ep, etp=etp, rank=rank, tp_group="tp")
        mesh.new_group = lambda ranks=None, backend=None: tuple(ranks)
        _tp_subgroups(mesh)
        out.append((mesh.etp_group, mesh.fold_group))
    return out


def test_an_etp_below_tp_cuts_each_tp_group_into_etp_neighbours_and_ranks_etp_apart():
    # the etp ranks splitting an expert are neighbours; the ranks etp apart share the tokens and fold them
    assert _tp_cuts(tp=4, dp=2, etp=2)[4:] == [((4, 5), (4, 6)), ((4, 5), (5, 7)), ((6, 7), (4, 6)), ((6, 7), (5, 7))]
    # etp=1: the whole tp group folds; etp=tp: the whole tp group splits each expert
    assert _tp_cuts(tp=4, dp=1, etp=1)[0] == (None, "tp") and _tp_cuts(tp=4, dp=1, etp=4)[3] == ("tp", None)


def test_one_process_matches_the_loop():
    x, idx, w = _tokens(0)
    x.requires_grad_(True)
    weights = _experts()
    y = _moe(x, idx, w, weights, None, 0)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    assert torch.allclose(y, ref, atol=1e-12)
    y.square().sum().backward()
    ref.square().sum().backward()
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-12)


def _ep2(rank, world):
    torch_dist.init_process_group("gloo")
    group = torch_dist.new_group([0, 1])
    out = {}
    weights = _experts()
    local = E // world
    mine = weights[rank * local:(rank + 1) * local]
    # identity experts and weights 1/k: combine returns the input, and its gradient
    x, idx, _ = _tokens(rank)
    x.requires_grad_(True)
    rows, per_expert, d = dispatch(x, idx, E, group)
    y = combine(rows, torch.full((x.shape[0], K), 1.0 / K, dtype=x.dtype), d, group)
    g = torch.randn_like(x)
    y.backward(g)
    out["identity"] = (torch.allclose(y, x), torch.allclose(x.grad, g))
    # real experts: each rank's tokens as one process computes them with every expert
    x, idx, w = _tokens(rank)
    x.requires_grad_(True)
    y = _moe(x, idx, w, mine, group, 0)
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    ref.square().sum().backward()
    out["experts"] = ((y - ref).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())
    # a rank that sends nothing to the other, and an expert that gets no token
    x, idx, w = _tokens(rank, n=3)
    idx = torch.full_like(idx, 0) if rank == 0 else torch.stack([torch.tensor([0, 1])] * 3)
    x.requires_grad_(True)
    y = _moe(x, idx, w, mine, group, 0)
    y.sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    ref.sum().backward()
    out["empty"] = ((y - ref).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())
    # a capacity counts each rank's own tokens: ep=2 equals the one-expert-set loop with that capacity
    x, idx, w = _tokens(rank, n=9)
    rows, per_expert, d = dispatch(x, idx, E, group, 3)
    outs = [chunk @ mine[e] for e, chunk in enumerate(rows.split(per_expert))]
    y = combine(torch.cat(outs), w, d, group)
    out["capacity"] = (y - _capacity_reference(x, idx, w, weights, 3)).abs().max().item()
    # folded: both ranks hold the same 5 tokens (tp ranks of an ep group); each dispatches its rows (3 and 2)
    x, idx, w = _tokens(0, n=5)
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    y = comm.gather_from_rows(_moe(comm.scatter_to_rows(x, group), comm.split_rows(idx, group),
                                   comm.scatter_to_rows(w, group), mine, group, 0), 5, group)
    y.square().sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    _reference(ref_x, idx, ref_w, weights).square().sum().backward()
    out["folded"] = ((y - _reference(x, idx, w, weights)).abs().max().item(), (x.grad - ref_x.grad).abs().max().item(),
                     (w.grad - ref_w.grad).abs().max().item())
    return out


def test_two_ranks_match_one_process():
    for got in dist.run(2, _ep2, timeout=300):
        assert got["identity"] == (True, True)
        assert max(got["experts"]) < 1e-12, got
        assert max(got["empty"]) < 1e-12, got
        assert got["capacity"] < 1e-12, got
        assert max(got["folded"]) < 1e-12, got


def _block(family):
    """A tiny mixture-of-experts block of each family (4 experts, top-2, hidden 8), seeded and initialized
    (transformers 5.x leaves a bare block's 3-D expert weights uninitialized)."""
    block = _bare_block(family)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def _bare_block(family):
    torch.manual_seed(0)
    if family == "example":
        from examples.gpt.model import GPTConfig, MoE

        return MoE(GPTConfig(n_embd=8, n_expert=4, n_expert_per_token=2))
    if family == "litgpt":
        from litgpt.config import Config
        from litgpt.model import LLaMAMoE

        return LLaMAMoE(Config(n_embd=8, n_head=2, n_expert=4, n_expert_per_token=2, moe_intermediate_size=12,
                               mlp_class_name="LLaMAMoE", intermediate_size=12))
    import transformers as T

    if family == "switch":  # top-1, at most 2 of a sequence's tokens per expert
        from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

        return SwitchTransformersSparseMLP(T.SwitchTransformersConfig(d_model=8, d_ff=12, num_experts=4,
                                                                      expert_capacity=2, router_jitter_noise=0.0,
                                                                      dropout_rate=0.0))
    common = dict(hidden_size=8, intermediate_size=12, num_experts_per_tok=2)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        return MixtralSparseMoeBlock(T.MixtralConfig(**common, num_local_experts=4))
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        return Qwen2MoeSparseMoeBlock(T.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=12,
                                                      shared_expert_intermediate_size=16, norm_topk_prob=False))
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    return OlmoeSparseMoeBlock(T.OlmoeConfig(**common, num_experts=4, norm_topk_prob=True))


FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "litgpt", "example")


def _compare(block, replaced, x):
    """Forward and input/parameter gradients of the block and its replacement on ``x``."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    a, b = block(xa), replaced(xb)
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    g = torch.randn_like(a[0])
    (a[0] * g).sum().backward()
    (b[0] * g).sum().backward()
    out = max((p - q).abs().max().item() for p, q in zip(a, b))
    grads = {n: p.grad for n, p in block.named_parameters()}
    # an expert no token chose keeps no gradient where the family's own loop skips it (an optimizer then leaves
    # it as it is), a zero one where the loop calls it
    none = {n for n, p in block.named_parameters() if p.grad is None}
    assert none == {n for n, p in replaced.named_parameters() if p.grad is None}, (type(block).__name__, none)
    param = max(((grads[n] - p.grad).abs().max().item() for n, p in replaced.named_parameters() if n not in none),
                default=0.0)
    return out, (xa.grad - xb.grad).abs().max().item(), param


def test_families_one_process_match_the_blocks():
    import copy

    from lightning_tp.experts.families import family_of
    from lightning_tp.experts.blocks.layer import ExpertParallelMoE

    from lightning_tp.experts.blocks.fused import expert_parallel_experts
    from lightning_tp.experts.blocks.switch import switch_parallel

    for family in FAMILIES + ("switch",):
        if not installed(family):
            continue
        for tokens in (5, 1):  # one token: two of the four experts idle
            block = _block(family)
            if family == "switch":
                replaced = switch_parallel(copy.deepcopy(block), None, 1, 0)
            elif family_of(block).fused:  # transformers 5.x: the block stays, its experts module is dispatched
                replaced = copy.deepcopy(block)
                expert_parallel_experts(replaced.experts, None, 1, 0)
            else:
                replaced = ExpertParallelMoE(copy.deepcopy(block), family_of(block), None, 1, 0)
            assert set(dict(replaced.named_parameters())) == set(dict(block.named_parameters())), family
            got = _compare(block, replaced, torch.randn(3, tokens, 8))
            assert max(got) < 1e-6, (family, got)


# ---------------------------------------------------------------- MegaStrategy(ep=...) against one process

import lightning as L  # noqa: E402

from lightning_tp import MegaStrategy, consolidate  # noqa: E402
from models import (LossRecorder, TokenData, make_model, reference_run, runnable, trainer_kwargs,  # noqa: E402
                    transformers_major, vocab_of)

STEPS, BATCH = 10, 4
AUX = dict(config_kw=dict(output_router_logits=True, router_aux_loss_coef=0.5))
# name: (world, model kind, model kwargs, strategy kwargs)
EP_RUNS = {
    "gpt_moe_ep2": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                    dict(ep=2)),
    "hf_mixtral_ep2": (2, "hf_mixtral", {}, dict(ep=2)),
    "hf_qwen2_moe_ep2": (2, "hf_qwen2_moe", {}, dict(ep=2)),
    # the router's load-balancing loss in the loss: statistics over the global batch, as one process
    "hf_mixtral_aux_ep2": (2, "hf_mixtral", dict(config_kw=dict(output_router_logits=True, router_aux_loss_coef=0.5)),
                           dict(ep=2)),
    "hf_mixtral_aux_dp2": (2, "hf_mixtral", dict(config_kw=dict(output_router_logits=True, router_aux_loss_coef=0.5)),
                           dict()),
    "hf_olmoe_ep2": (2, "hf_olmoe", {}, dict(ep=2)),
    # two param groups (decayed matrices, the rest at another rate): the sliced experts are the optimizer's
    "hf_mixtral_tp2_ep2_two_groups": (2, "hf_mixtral", dict(two_groups=True), dict(tp=2, ep=2)),
    "litgpt_moe_ep2": (2, "litgpt", dict(n_expert=4), dict(ep=2)),
    # 4 processes: 2 stages, each with its experts split over its 2 dp ranks
    "hf_mixtral_pp2_ep2": (4, "hf_mixtral", {}, dict(pp=2, ep=2, microbatches=2)),
    "gpt_moe_dp4_ep2": (4, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                        dict(ep=2)),
    # under tp the experts are held whole per rank; under sp the router sees sequence shards and the
    # load-balancing statistics the whole sequence
    "gpt_moe_tp2_sp": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                       dict(tp=2, sp=True)),
    "hf_mixtral_tp2_sp_ep2": (4, "hf_mixtral", {}, dict(tp=2, sp=True, ep=2)),
    "hf_mixtral_tp2_ep2": (4, "hf_mixtral", {}, dict(tp=2, ep=2)),
    "hf_mixtral_aux_tp2_sp_ep2": (4, "hf_mixtral",
                                  dict(config_kw=dict(output_router_logits=True, router_aux_loss_coef=0.5)),
                                  dict(tp=2, sp=True, ep=2)),
    "gpt_moe_pp2_ep1": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                        dict(pp=2, microbatches=2)),
    # experts beyond dp (parallel folding): ep groups over a stage's tp x dp ranks, tp first; without sp an
    # ep group's tp ranks split the tokens they share
    "hf_mixtral_tp2_dp1_ep2": (2, "hf_mixtral", {}, dict(tp=2, ep=2)),
    "gpt_moe_tp2_dp1_ep2": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                            dict(tp=2, ep=2)),
    "hf_mixtral_tp2_dp2_ep4": (4, "hf_mixtral", {}, dict(tp=2, ep=4)),
    # expert tensor parallelism: each expert's MLP split over the tp ranks (its down bias added on the first),
    # the tokens alike on them (a sequence shard's gathered under sp); ep over dp
    "gpt_moe_tp2_etp2": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                         dict(tp=2, etp=2)),
    "gpt_moe_tp2_sp_etp2": (2, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                            dict(tp=2, sp=True, etp=2)),
    "gpt_moe_tp2_dp2_ep2_etp2": (4, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                                n_embd=32), dict(tp=2, ep=2, etp=2)),
    "gpt_moe_tp2_sp_pp2_etp2": (4, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4,
                                               n_embd=32), dict(tp=2, sp=True, pp=2, etp=2, microbatches=2)),
    # etp below tp: each expert over a tp pair, the experts over the pairs (ep=2 folded over tp); without sp the
    # ranks two apart split the tokens they share; the down bias added on each pair's first, summed over the pair
    "gpt_moe_tp4_ep2_etp2": (4, "gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                             dict(tp=4, ep=2, etp=2)),
}
# etp on both majors: 4.x's ModuleList experts, 5.x's 3-D ones (their width sliced, experts over ep: two dims)
EP_RUNS.update({
    "hf_mixtral_tp2_sp_etp2": (2, "hf_mixtral", {}, dict(tp=2, sp=True, etp=2)),
    "hf_mixtral_aux_tp2_sp_dp2_ep2_etp2": (4, "hf_mixtral", AUX, dict(tp=2, sp=True, ep=2, etp=2)),
    "hf_qwen2_moe_tp2_dp2_ep2_etp2": (4, "hf_qwen2_moe", {}, dict(tp=2, ep=2, etp=2)),
    "litgpt_moe_tp2_etp2": (2, "litgpt", dict(n_expert=4), dict(tp=2, etp=2)),
})
if transformers_major() < 5:  # etp below tp on sequence shards: 4.x's ModuleList experts (5.x's: GPT-OSS below)
    EP_RUNS["hf_mixtral_tp4_sp_ep2_etp2"] = (4, "hf_mixtral", dict(kv_heads=4), dict(tp=4, sp=True, ep=2, etp=2))
if transformers_major() >= 5:  # expert biases and interleaved [gate, up] pairs; its attention (sinks) split over tp
    EP_RUNS["hf_gpt_oss_tp2_etp2"] = (2, "hf_gpt_oss", {}, dict(tp=2, etp=2))
    EP_RUNS["hf_gpt_oss_tp2_ep2"] = (2, "hf_gpt_oss", {}, dict(tp=2, ep=2))
    EP_RUNS["hf_gpt_oss_tp2_sp_ep2"] = (4, "hf_gpt_oss", {}, dict(tp=2, sp=True, ep=2))
    EP_RUNS["hf_gpt_oss_tp2_dp2_ep2_etp2"] = (4, "hf_gpt_oss", {}, dict(tp=2, ep=2, etp=2))
    EP_RUNS["hf_gpt_oss_tp4_sp_ep2_etp2"] = (4, "hf_gpt_oss", dict(kv_heads=4), dict(tp=4, sp=True, ep=2, etp=2))
# every family at tp x ep and pp x ep (with Mixtral's above): Qwen2-MoE's shared expert, OLMoE's q/k norms
EP_RUNS.update({
    "hf_qwen2_moe_tp2_ep2": (2, "hf_qwen2_moe", {}, dict(tp=2, ep=2)),
    "hf_qwen2_moe_tp2_sp_ep2": (4, "hf_qwen2_moe", {}, dict(tp=2, sp=True, ep=2)),
    "hf_olmoe_pp2_ep2": (4, "hf_olmoe", {}, dict(pp=2, ep=2, microbatches=2)),
})
# Qwen3-MoE: on 4.x a known block (its config's tp plan names the experts' own layers), on 5.x fused experts
EP_RUNS["hf_qwen3_moe_tp2_ep2"] = (4, "hf_qwen3_moe", {}, dict(tp=2, ep=2))
EP_RUNS["hf_olmoe_tp2_sp_ep2"] = (4, "hf_olmoe", {}, dict(tp=2, sp=True, ep=2))  # 4.x: this project's plan
if transformers_major() >= 5:  # families whose experts are one module of 3-D weights
    EP_RUNS.update({
        "hf_qwen3_moe_ep2": (2, "hf_qwen3_moe", {}, dict(ep=2)),
        "hf_deepseek_v3_ep2": (2, "hf_deepseek_v3", {}, dict(ep=2)),
        "hf_gpt_oss_ep2": (2, "hf_gpt_oss", {}, dict(ep=2)),
        "hf_qwen3_moe_aux_tp2_sp_ep2": (4, "hf_qwen3_moe", AUX, dict(tp=2, sp=True, ep=2)),
        "hf_deepseek_v3_pp2_ep2": (4, "hf_deepseek_v3", {}, dict(pp=2, ep=2, microbatches=2)),
        # MLA under tp: q_b / kv_b split in heads, the shared latents (q_a, kv_a with the rotary key) whole on
        # each rank with their gradients summed over tp; the shared expert split over tp, the routed ones over ep
        "hf_deepseek_v3_tp2_ep2": (2, "hf_deepseek_v3", {}, dict(tp=2, ep=2)),
        "hf_deepseek_v3_tp2_sp_ep2": (4, "hf_deepseek_v3", {}, dict(tp=2, sp=True, ep=2)),
    })
# a dense layer after an MoE one (Qwen2-MoE's mlp_only_layers): its MLP split over tp by the config's plan, not left
# whole (whole, its gradients were one sequence shard's under sp)
EP_RUNS["hf_qwen2_moe_dense_second_tp2_sp"] = (2, "hf_qwen2_moe", dict(config_kw=dict(mlp_only_layers=[1])),
                                               dict(tp=2, sp=True))
# Llama 4 (5.x): its own block (experts/llama4.py); a dense first layer beside the MoE one, split over tp under sp;
# under pp its first stage holds no experts and the second computes its side inputs from a placeholder's meta weight
if transformers_major() >= 5:
    EP_RUNS.update({"hf_llama4_ep2": (2, "hf_llama4", {}, dict(ep=2)),
                    "hf_llama4_tp2_sp_ep2": (4, "hf_llama4", {}, dict(tp=2, sp=True, ep=2)),
                    "hf_llama4_pp2_ep2": (4, "hf_llama4", {}, dict(pp=2, ep=2, microbatches=2))})
# an encoder-decoder: Switch Transformers' top-1 experts in every second block, its router's capacity per
# sequence dropping tokens, its router z-loss and load-balancing loss in the loss (per row: a microbatch's
# equal the batch's); the T5 plan's tp with the experts whole, or folded over the tp pair; under pp each
# stack's router logits reach the last stage behind the packed message (split inside the decoder: the
# encoder's and the decoder's travel together)
EP_RUNS.update({
    "hf_switch_ep2": (2, "hf_switch", {}, dict(ep=2)),
    "hf_switch_tp2_ep2": (2, "hf_switch", {}, dict(tp=2, ep=2)),
    "hf_switch_tp2_sp": (2, "hf_switch", {}, dict(tp=2, sp=True)),
    "hf_switch_pp2_split_decoder": (2, "hf_switch", {}, dict(pp=2, microbatches=2, stage_layers=[3, 1])),
    "hf_switch_tp2_sp_ep2": (4, "hf_switch", {}, dict(tp=2, sp=True, ep=2)),
    "hf_switch_pp2_ep2": (4, "hf_switch", {}, dict(pp=2, ep=2, microbatches=2)),
    # under sp the encoder's layers' logits travel as sequence shards, past the encoder's whole output
    "hf_switch_pp2_tp2_sp_split_decoder": (4, "hf_switch", {}, dict(pp=2, tp=2, sp=True, microbatches=2,
                                                                     stage_layers=[3, 1])),
    # split inside the encoder (4 blocks a stack): the first stage's encoder logits travel past its half-done
    # encoder's output, the encoder's rest and the decoder on the second stage
    "hf_switch_pp2_tp2_sp_split_encoder": (4, "hf_switch", dict(layers=4), dict(pp=2, tp=2, sp=True, microbatches=2,
                                                                                stage_layers=[2, 6])),
})
EP_RUNS = runnable(EP_RUNS, 1)
PARTLY_DENSE = {"hf_deepseek_v3", "hf_llama4"}  # their first layer is dense: under pp one stage holds no experts


def _expert_weight(name: str) -> bool:
    return ".experts." in name and "bias" not in name.rpartition(".")[2]


def _fit_ep(rank, world, runs, ckdir):
    torch_dist.init_process_group("gloo")
    out = {}
    for name, (_, kind, model_kw, strategy_kw) in runs.items():
        model = make_model(kind, **model_kw)
        rec = LossRecorder()
        strategy = MegaStrategy(**strategy_kw, timeout=120)
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=STEPS, callbacks=[rec], **trainer_kwargs())
        dp = world // (strategy.tp * strategy.pp)
        trainer.fit(model, TokenData(STEPS * BATCH * dp, vocab_of(model), BATCH))
        path = f"{ckdir}/{name}.ckpt"
        trainer.save_checkpoint(path)
        # the experts' weights, not biases (a down projection's bias stays whole on each tp rank under etp)
        experts = sum(p.numel() for n, p in model.named_parameters() if _expert_weight(n))
        out[name] = dict(losses=rec.losses, weights=consolidate(path) if rank == 0 else None, experts=experts)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process(tmp_path, world):
    runs = {name: run for name, run in EP_RUNS.items() if run[0] == world}
    results = dist.run(world, _fit_ep, runs, str(tmp_path), timeout=900)
    for name, (world, kind, model_kw, strategy_kw) in runs.items():
        tp = strategy_kw.get("tp", 1)
        dp = world // (tp * strategy_kw.get("pp", 1))
        ref_losses, ref_weights, _ = reference_run(kind, model_kw, STEPS, BATCH * dp)
        full = sum(v.numel() for k, v in ref_weights.items() if _expert_weight(k))
        for r in results:
            got = r[name]
            assert len(got["losses"]) == STEPS
            diff = (torch.tensor(got["losses"]) - torch.tensor(ref_losses)).abs().max().item()
            assert diff < 1e-5, (name, diff, got["losses"], ref_losses)
        ep, pp, etp = strategy_kw.get("ep", 1), strategy_kw.get("pp", 1), strategy_kw.get("etp", 1)
        if ep * etp > 1:  # each rank holds 1/ep of its stage's experts (1/etp of each): a stage's ranks hold them once
            assert sum(r[name]["experts"] for r in results) == full * tp * dp // (ep * etp), name
            if kind not in PARTLY_DENSE:  # every block an MoE one: each stage holds the same share
                assert {r[name]["experts"] for r in results} == {full // (ep * etp * pp)}, name
        weights = results[0][name]["weights"]
        assert set(weights) == set(ref_weights), name
        worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst < 1e-5, (name, worst)


# the router's load-balancing loss under a pipeline: every layer's logits reach the last stage with the
# activations; its statistics are each microbatch's (over the dp replicas' rows), as one process
# accumulating the same microbatches computes them. name: (world, model kind, model kwargs, strategy kwargs)
AUX_PP_RUNS = {
    "mixtral_pp2_padded": (2, "hf_mixtral", dict(AUX, padded=True), dict(pp=2, microbatches=2)),  # a mask
    "qwen2_moe_pp2": (2, "hf_qwen2_moe", AUX, dict(pp=2, microbatches=2)),  # stand-ins in the logits' tuple
    "mixtral_pp2_interleaved_ckpt": (2, "hf_mixtral", dict(AUX, layers=4),
                                     dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", microbatches=2,
                                          activation_checkpointing=True)),
    "mixtral_pp2_ep2": (4, "hf_mixtral", AUX, dict(pp=2, ep=2, microbatches=2)),
    "qwen2_moe_pp2_ep2": (4, "hf_qwen2_moe", AUX, dict(pp=2, ep=2, microbatches=2)),
    "mixtral_pp2_tp2_sp": (4, "hf_mixtral", AUX, dict(pp=2, tp=2, sp=True, microbatches=2)),
    # the other families with a load-balancing loss at pp=2 x ep=2: OLMoE (its q/k norms), Qwen3-MoE
    "olmoe_pp2_ep2": (4, "hf_olmoe", AUX, dict(pp=2, ep=2, microbatches=2)),
    "qwen3_moe_pp2_ep2": (4, "hf_qwen3_moe", AUX, dict(pp=2, ep=2, microbatches=2)),
}
if transformers_major() >= 5:  # the logits come from the router module itself, the block returns hidden states
    AUX_PP_RUNS.update({"qwen3_moe_pp2": (2, "hf_qwen3_moe", AUX, dict(pp=2, microbatches=2)),
                        "gpt_oss_pp2_ep2": (4, "hf_gpt_oss", AUX, dict(pp=2, ep=2, microbatches=2))})
AUX_PP_RUNS = runnable(AUX_PP_RUNS, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_router_loss_under_a_pipeline_matches_one_process_accumulating_its_microbatches(tmp_path, world):
    runs = {name: run for name, run in AUX_PP_RUNS.items() if run[0] == world}
    results = dist.run(world, _fit_ep, runs, str(tmp_path), timeout=900)
    for name, (world, kind, model_kw, strategy_kw) in runs.items():
        m = strategy_kw["microbatches"]
        dp = world // (strategy_kw.get("tp", 1) * strategy_kw["pp"])
        ref_losses, ref_weights, _ = reference_run(kind, model_kw, STEPS, BATCH * dp // m, accumulate_grad_batches=m)
        per_step = torch.tensor(ref_losses).view(STEPS, m).mean(1)
        for r in results:
            diff = (torch.tensor(r[name]["losses"]) - per_step).abs().max().item()
            assert diff < 1e-5, (name, diff, r[name]["losses"], per_step)
        weights = results[0][name]["weights"]
        worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst < 1e-5, (name, worst)


from helpers import BAD_EXPERTS, GPT_MOE  # noqa: E402

# and a mixture-of-experts layer of no family this project knows (a user's own, undeclared): named, with the plan
BAD = dict(BAD_EXPERTS, unknown_moe_layer=(dict(kind="custom_moe"), dict(ep=2), "moes.0 (TopKRouted), moes.1 "
                                           "(TopKRouted); declare them in a plan, e.g. plan={'styles': {'moes.*': "
                                           "{'style': 'experts'"))
if installed("hf_switch"):  # Switch Transformers' router caps its experts itself; its experts stay whole over tp
    BAD.update(switch_capacity=(dict(kind="hf_switch"), dict(ep=2, moe_capacity=1.0),
                                "encoder.block.1.layer.1.mlp (SwitchTransformersSparseMLP) is Switch Transformers'"),
               switch_etp=(dict(kind="hf_switch"), dict(tp=2, etp=2), "leave etp at its default"))
if transformers_major() >= 5:  # Llama 4's experts are not split over tp (its own layout of 3-D weights)
    BAD["llama4_etp"] = (dict(kind="hf_llama4"), dict(tp=2, etp=2), "model.model.layers.1.feed_forward (Llama4TextMoe) is "
                                                                    "Llama 4's mixture of experts")


def _bad(rank, world):
    out = {}
    for name, (model_kw, strategy_kw, _) in BAD.items():
        try:
            trainer = L.Trainer(devices=world, strategy=MegaStrategy(**strategy_kw, timeout=60), max_steps=1,
                                **trainer_kwargs())
            kw = dict(model_kw)
            kind = kw.pop("kind", "gpt")
            model = CustomMoELM() if kind == "custom_moe" else make_model(kind, **kw)
            trainer.fit(model, TokenData(8, 64, 2))
            out[name] = None
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[name] = f"{type(e).__name__}: {e} " + " ".join(getattr(e, "__notes__", []))  # a lost peer's note
    return out


def test_explain_counts_switch_transformers_experts_per_rank():
    """An encoder-decoder's experts: explain's parameters per rank at ep=2 and tp=2 x ep=2 (folded) hold half of
    each MoE layer's experts, the rest as at ep=1."""
    if not installed("hf_switch"):
        return
    from lightning_tp.explain.estimate import explain

    model = make_model("hf_switch")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0
    for layout in (dict(ep=2, dp=2), dict(tp=2, ep=2)):
        whole = explain(make_model("hf_switch"), batch_shape=(4, 16), print_report=False, **{**layout, "ep": 1})
        split = explain(make_model("hf_switch"), batch_shape=(4, 16), print_report=False, **layout)
        assert [r.params for r in split.ranks] == [r.params - experts // 2 for r in whole.ranks], layout
    assert explain(model, batch_shape=(4, 16), print_report=False, dp=2).ranks[0].params == total


def test_bad_expert_layouts_fail_on_every_rank_with_a_clear_error():
    for got in dist.run(2, _bad, timeout=300):
        for name, (_, _, message) in BAD.items():
            assert got[name] is not None and message in got[name], (name, got[name])


COUNTED = {"dp2_ep2": dict(ep=2), "tp2_ep2": dict(tp=2, ep=2)}  # the second folded: each tp rank sends half the rows


def _counted(rank, world):
    from lightning_tp import comm

    torch_dist.init_process_group("gloo")
    out = {}
    for name, layout in COUNTED.items():
        model = make_model("gpt", **dict(GPT_MOE, n_expert=4))
        strategy = MegaStrategy(**layout, timeout=120)
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=3, limit_val_batches=0, **trainer_kwargs())
        dp = world // strategy.tp
        with comm.count_collectives() as records:
            trainer.fit(model, TokenData(3 * BATCH * dp, 64, BATCH))
        mesh = strategy.mesh
        by = {}
        for op, numel, group in records:
            kind = {id(mesh.ep_group): "ep", id(mesh.dp_group): "dp"}.get(id(group), "other")
            by[(op, kind)] = by.get((op, kind), 0) + numel
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        out[name] = dict(by={k: v / 3 for k, v in by.items()}, params=sum(p.numel() for p in model.parameters()),
                         experts=experts)
    return out


def test_explain_counts_each_ranks_share_of_the_expert_weights():
    """On 5.x a block of each 3-D weight (experts over ep by width over etp), on 4.x the list's slices."""
    from lightning_tp.config import ParallelConfig
    from lightning_tp.explain.estimate import explain

    model = make_model("hf_mixtral")
    full = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    for layout, share in ((dict(ep=2), 2), (dict(tp=2, ep=2, etp=2), 4), (dict(tp=2, etp=2), 2),
                          (dict(tp=4, ep=2, etp=2), 4)):
        est = explain(model, config=ParallelConfig.resolve(**layout).with_world(4), batch_shape=(4, 16),
                      print_report=False)
        assert {r.expert_params for r in est.ranks} == {full // share}, layout
        assert all(r.ep_bytes > 0 for r in est.ranks) == (layout.get("ep", 1) > 1), layout


def test_explain_counts_expert_parameters_and_all_to_all_bytes_of_a_run():
    from lightning_tp.explain.estimate import explain

    runs = dist.run(2, _counted, timeout=300)
    for name, layout in COUNTED.items():
        got = [r[name] for r in runs]
        est = explain(make_model("gpt", **dict(GPT_MOE, n_expert=4)), dp=2 // layout.get("tp", 1), **layout,
                      batch_shape=(BATCH, GPT_MOE["block_size"]), print_report=False).rank(0)
        for r in got:
            assert r["params"] == est.params and r["experts"] == est.expert_params, (name, r, est)
        rows = sum(r["by"].get(("all_to_all", "ep"), 0) for r in got) * 4  # float32 rows, both ranks
        counts = sum(r["by"].get(("all_to_all_counts", "ep"), 0) for r in got) * 8  # int64 expert counts
        assert rows + counts == 2 * est.ep_bytes, (name, rows, counts, est.ep_bytes)  # balanced per rank, exact summed
        if name == "dp2_ep2":  # the dense parameters' dp all-reduce is explain's DP grads; the experts' is not (edp
            # = 1 here) (plus one has-a-gradient flag per parameter in each bucket, see grads.with_flags)
            assert got[0]["by"][("all_reduce", "dp")] * 4 == pytest.approx(est.dp_bytes, rel=0.01)
            assert est.edp_bytes == 0


def _resume_and_load_full(rank, world, ckdir):
    torch_dist.init_process_group("gloo")
    kw = dict(GPT_MOE, n_expert=4)

    def fit(epochs, ckpt_path=None, ckdir_=None):
        from lightning.pytorch.callbacks import ModelCheckpoint

        rec = LossRecorder()
        saver = ModelCheckpoint(dirpath=ckdir_, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(ep=2, timeout=120), max_epochs=epochs,
                            callbacks=[rec, saver], limit_val_batches=0, **trainer_kwargs(enable_checkpointing=True))
        model = make_model("gpt", **kw)
        trainer.fit(model, TokenData(3 * BATCH * world, 64, BATCH), ckpt_path=ckpt_path)  # 3 steps an epoch
        return rec.losses

    straight = fit(2, ckdir_=f"{ckdir}/a")
    first = straight[:3]
    resumed = fit(2, ckpt_path=f"{ckdir}/a/epoch=0.ckpt", ckdir_=f"{ckdir}/b")
    # a plain state_dict of the whole model lands each expert on the rank that holds it
    if rank == 0:
        torch.manual_seed(123)
        torch.save({k: torch.randn_like(v) for k, v in make_model("gpt", **kw).state_dict().items()}, f"{ckdir}/full.pt")
    torch_dist.barrier()
    full = torch.load(f"{ckdir}/full.pt", weights_only=True)
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(ep=2, load_full=f"{ckdir}/full.pt", timeout=120),
                        max_steps=1, limit_val_batches=1, **trainer_kwargs())
    model = make_model("gpt", **kw)
    trainer.validate(model, dataloaders=TokenData(8, 64, BATCH).train_dataloader())
    local = model.state_dict()
    loaded = max((local[k] - full[k]).abs().max().item() for k in local)
    experts = sorted({k.split(".experts.")[1].split(".")[0] for k in local if ".experts." in k})
    return dict(straight=straight, first=first, resumed=resumed, loaded=loaded, experts=experts)


def test_expert_checkpoints_resume_exactly_and_load_full_places_each_expert(tmp_path):
    got = dist.run(2, _resume_and_load_full, str(tmp_path), timeout=600)
    for r in got:
        assert len(r["straight"]) == 6 and len(r["resumed"]) == 3
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["straight"][3:])) < 1e-6, r
        assert r["loaded"] == 0.0
    assert [r["experts"] for r in got] == [["0", "1"], ["2", "3"]]


def _capacity_reference(x, idx, w, weights, capacity):
    """The per-expert loop keeping each expert's first ``capacity`` (token, slot) pairs in token order."""
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        tok, slot = tok[:capacity], slot[:capacity]
        out.index_add_(0, tok, (x[tok] @ weights[e]) * w[tok, slot, None])
    return out


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    from lightning_tp.experts.dispatch import capacity_of

    x, idx, w = _tokens(0, n=9)
    weights = _experts()
    for factor in (0.5, 1.0, 8.0):
        cap = capacity_of(factor, 9, K, E)
        rows, per_expert, d = dispatch(x, idx, E, None, cap)
        assert max(per_expert) <= cap
        y = combine(torch.cat([c @ weights[e] for e, c in enumerate(rows.split(per_expert))]), w, d)
        assert torch.allclose(y, _capacity_reference(x, idx, w, weights, cap), atol=1e-12), factor
    assert capacity_of(1.0, 9, K, E) == 5 and capacity_of(8.0, 9, K, E) >= 9  # 8: nothing dropped here
    assert torch.allclose(y, _reference(x, idx, w, weights), atol=1e-12)


# ---------------------------------------------------------------- a custom MoE layer declared in a user plan

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class TopKRouted(nn.Module):
    """A user's own MoE layer (no family this project knows): top-k of the logits, softmax over them."""

    def __init__(self, width: int, n: int, k: int):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(width, n, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(n))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        top, chosen = torch.topk(self.gate(flat), self.k)
        weights = top.softmax(dim=-1)
        y = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y[token] += weights[token, slot, None] * expert(flat[token])
        return y.reshape(x.shape)


class CustomMoELM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16)
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
        self.moes = nn.ModuleList(TopKRouted(16, 4, 2) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        loss = F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-4)


CUSTOM_MOE_PLAN = {"name": "my_moe", "styles": {"moes.*": {"style": "experts", "top_k": "k", "router": "topk_softmax"}}}


def _custom(rank, world):
    torch_dist.init_process_group("gloo")
    rec = LossRecorder()
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(ep=2, plan=CUSTOM_MOE_PLAN, timeout=120), max_steps=STEPS,
                        callbacks=[rec], limit_val_batches=0, **trainer_kwargs())
    model = CustomMoELM()
    trainer.fit(model, TokenData(STEPS * BATCH * world, 64, BATCH))
    return rec.losses, sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def test_a_custom_moe_layer_declared_in_a_plan_is_expert_parallel():
    got = dist.run(2, _custom, timeout=300)
    rec = LossRecorder()
    model = CustomMoELM()
    full = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    trainer = L.Trainer(devices=1, max_steps=STEPS, callbacks=[rec], use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(model, TokenData(STEPS * BATCH * 2, 64, BATCH * 2, single=True))
    for losses, experts in got:
        assert max(abs(a - b) for a, b in zip(losses, rec.losses)) < 1e-5, (losses, rec.losses)
        assert experts * 2 == full


def test_experts_style_options_are_checked():
    from lightning_tp import Plan

    with pytest.raises(ValueError, match="needs the option 'top_k'"):
        Plan(name="p", styles={"moes.*": {"style": "experts"}})
    with pytest.raises(ValueError, match="must be 'softmax_topk' or 'topk_softmax'"):
        Plan(name="p", styles={"moes.*": {"style": "experts", "top_k": 2, "router": "sinkhorn"}})


def _aux_grads(rank, world):
    from transformers.models.mixtral import modeling_mixtral as mm

    from lightning_tp.experts.router_losses import statistics as router_statistics

    torch_dist.init_process_group("gloo")
    group = torch_dist.new_group([0, 1])
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(2 * 6, E, generator=g, dtype=torch.float64) for _ in range(3)]  # both ranks' tokens
    mask = (torch.rand(2 * 2, 3, generator=g) > 0.2).long()  # [batch, seq]: 2 rows a rank, 3 tokens each
    router_statistics.install(_block("mixtral"), group, 1)  # patches this process's modeling_mixtral
    wrapped = mm.load_balancing_loss_func
    mine = [t[rank * 6:(rank + 1) * 6].clone().requires_grad_(True) for t in layers]
    aux = wrapped(tuple(mine), E, K, mask[rank * 2:(rank + 1) * 2])
    aux.backward()
    return aux.item(), [t.grad / world for t in mine]  # the dp average divides the reduce-scattered sum


def test_router_loss_and_its_input_gradient_over_dp_equal_one_process():
    from transformers.models.mixtral import modeling_mixtral as mm

    got = dist.run(2, _aux_grads, timeout=300)
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(2 * 6, E, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(3)]
    mask = (torch.rand(2 * 2, 3, generator=g) > 0.2).long()
    original = getattr(mm.load_balancing_loss_func, "__wrapped__", mm.load_balancing_loss_func)
    ref = original(tuple(layers), E, K, mask)
    ref.backward()
    for rank, (aux, grads) in enumerate(got):
        assert abs(aux - ref.item()) < 1e-12
        for mine, full in zip(grads, layers):
            assert torch.allclose(mine, full.grad[rank * 6:(rank + 1) * 6], atol=1e-14)


def test_router_loss_asked_per_call_under_a_pipeline_is_refused_clearly():
    """The stages carry router logits only where the config asks for them: a tuple reaching the loss under
    pp > 1 without a carry says what to set."""
    from transformers.models.mixtral import modeling_mixtral as mm

    from lightning_tp.experts.router_losses import statistics as router_statistics

    router_statistics.install(_block("mixtral"), None, 2)
    try:
        with pytest.raises(ValueError, match="set config.output_router_logits=True"):
            mm.load_balancing_loss_func((torch.randn(6, E),), E, K)
    finally:
        router_statistics.install(_block("mixtral"), None, 1)


def test_router_jitter_applies_in_training_only_and_draws_as_the_block_does():
    """Mixtral's router jitter: the replacement draws the block's noise from the same generator (the same
    output as the block in training), none in eval."""
    import copy

    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    import transformers as T

    from lightning_tp.experts.families import family_of
    from lightning_tp.experts.blocks.layer import ExpertParallelMoE

    from lightning_tp.experts.blocks.fused import expert_parallel_experts

    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(T.MixtralConfig(hidden_size=8, intermediate_size=12, num_experts_per_tok=2,
                                                  num_local_experts=4, router_jitter_noise=0.3))
    with torch.no_grad():  # transformers 5 leaves a bare block's 3-D expert weights uninitialized
        for p in block.parameters():
            p.normal_(0, 0.3)

    def replacement(jitter: float):
        if family_of(block).fused:  # transformers 5: the block (its jitter) stays, its experts are dispatched
            new = copy.deepcopy(block)
            expert_parallel_experts(new.experts, None, 1, 0)
        else:
            new = ExpertParallelMoE(copy.deepcopy(block), family_of(block), None, 1, 0)
        new.jitter_noise = jitter
        return new

    replaced, still = replacement(0.3), replacement(0.0)
    x = torch.randn(3, 5, 8)

    def run(module, seed=1):
        torch.manual_seed(seed)
        out = module(x.clone())
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        assert torch.allclose(run(replaced), run(block), atol=1e-6, rtol=0)  # training: the block's draw
        assert not torch.allclose(run(replaced), run(still), atol=1e-3)  # and a draw it is
        for m in (block, replaced, still):
            m.eval()
        assert torch.equal(run(replaced), run(still)) and torch.allclose(run(block), run(still), atol=1e-6, rtol=0)


def _jitter_under_tp(rank, world):
    torch_dist.init_process_group("gloo")
    out = {}
    for name, layout in (("tp2", dict(tp=2)), ("tp2_sp", dict(tp=2, sp=True))):
        model = make_model("hf_mixtral", config_kw=dict(router_jitter_noise=0.2))
        rec = LossRecorder()
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(**layout, timeout=120), max_steps=STEPS,
                            callbacks=[rec], **trainer_kwargs())
        trainer.fit(model, TokenData(STEPS * BATCH, vocab_of(model), BATCH))
        out[name] = dict(losses=rec.losses, gates={n: p.detach().clone() for n, p in model.named_parameters()
                                                   if n.endswith("gate.weight")})
    return out


def test_router_jitter_draws_alike_on_the_tp_ranks_holding_the_same_tokens():
    """Under tp the ranks of a group route the same tokens (sp: each its shard of them, the router's gradient
    summed): their jittered routers stay bit-identical, and the jitter moves the losses off the jitter-free run."""
    results = dist.run(2, _jitter_under_tp, timeout=300)
    still, _, _ = reference_run("hf_mixtral", {}, STEPS, BATCH)
    for name in ("tp2", "tp2_sp"):
        a, b = results[0][name], results[1][name]
        assert a["gates"] and all(torch.equal(v, b["gates"][k]) for k, v in a["gates"].items()), name
        assert max(abs(x - y) for x, y in zip(a["losses"], still)) > 1e-4, name


def _load_full_under_etp(rank, world, ckdir, kind, model_kw):
    from lightning_tp.layers.shard import shard, spec_of

    torch_dist.init_process_group("gloo")
    if rank == 0:
        torch.manual_seed(123)
        torch.save({k: torch.randn_like(v) for k, v in make_model(kind, **model_kw).state_dict().items()},
                   f"{ckdir}/full.pt")
    torch_dist.barrier()
    full = torch.load(f"{ckdir}/full.pt", weights_only=True)
    strategy = MegaStrategy(tp=2, ep=2, etp=2, load_full=f"{ckdir}/full.pt", timeout=120)
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=0, **trainer_kwargs())  # set up, no step
    model = make_model(kind, **model_kw)
    trainer.fit(model, TokenData(8, vocab_of(model), BATCH))
    worst, held = 0.0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            spec = spec_of(p)
            want = full[name] if spec is None else shard(full[name], spec, strategy.mesh.tp_rank)
            worst = max(worst, (p.detach() - want).abs().max().item())
            held += p.numel() if _expert_weight(name) else 0
    return dict(worst=worst, held=held, whole=sum(v.numel() for k, v in full.items() if _expert_weight(k)))


@pytest.mark.parametrize("kind", ["hf_mixtral", "gpt"])
def test_load_full_puts_each_ranks_block_of_every_expert_in_place_under_etp(tmp_path, kind):
    """A plain state_dict of the whole model at tp=2 x dp=2 x ep=2 x etp=2: each rank holds a quarter of the
    expert weights (on transformers 5.x a block of each 3-D weight: two sharded dimensions), the file's own."""
    model_kw = dict(GPT_MOE, n_expert=4) if kind == "gpt" else {}
    for r in dist.run(4, _load_full_under_etp, str(tmp_path), kind, model_kw, timeout=600):
        assert r["worst"] == 0.0 and 4 * r["held"] == r["whole"], r


def _fit_twice(rank, world):
    """Mixtral with its load-balancing loss fitted by one Trainer, then by a second one with a new strategy (the
    same layout), then a third at another ep: refused."""
    if world > 1:
        torch_dist.init_process_group("gloo")
    model, losses = make_model("hf_mixtral", **AUX), []
    dp = 2  # the global batch of the 2-process run, whole in the one-process reference
    for _ in range(2):
        rec = LossRecorder()
        strategy = MegaStrategy(ep=world, timeout=120) if world > 1 else "auto"
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=3, callbacks=[rec], **trainer_kwargs())
        trainer.fit(model, TokenData(3 * BATCH * dp, vocab_of(model), BATCH * (dp if world == 1 else 1),
                                     single=world == 1))
        losses += rec.losses
        if world > 1:  # 5.x: the experts modules' groups; 4.x: the swapped blocks'
            groups = [getattr(m, "_lightning_tp_ep", {}).get("group", getattr(m, "group", None)) for m in model.modules()
                      if type(m).__name__.startswith("ExpertParallel")]
            assert groups and all(g is strategy.mesh.ep_group for g in groups), "an expert layer kept old groups"
    refused = None
    if world > 1:
        try:
            L.Trainer(devices=world, strategy=MegaStrategy(timeout=120), max_steps=1, **trainer_kwargs()).fit(
                model, TokenData(BATCH * dp, vocab_of(model), BATCH))
        except ValueError as e:
            refused = str(e)
    return dict(losses=losses, refused=refused)


def test_a_second_trainer_fits_an_expert_parallel_module_again_with_its_own_groups():
    """The expert layers and router statistics take the second strategy's groups (the first one's are gone);
    the losses of both fits equal one process fitting twice; another ep is refused."""
    got = dist.run(2, _fit_twice, timeout=600)
    ref = dist.run(1, _fit_twice, timeout=600)[0]
    for r in got:
        assert len(r["losses"]) == 6
        assert (torch.tensor(r["losses"]) - torch.tensor(ref["losses"])).abs().max() < 1e-5, (r, ref)
        assert "already parallelized with" in r["refused"] and "ep=2" in r["refused"], r["refused"]
