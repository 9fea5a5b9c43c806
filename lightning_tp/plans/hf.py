"""Plans for Hugging Face transformers models: built from a config's ``base_model_tp_plan``, or
hand-written (GPT-2, OPT). See docs/design/plans.md."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ..experts.families import find_moe_blocks
from .base import Plan


def norm_paths(layer: nn.Module, glob_prefix: str) -> dict:
    return {f"{glob_prefix}.{name}": "sp_norm" for name, m in layer.named_children()
            if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))}


ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}  # transformers 4.x names
OUTPUT_PROJECTIONS = (".out_proj", ".o_proj")  # a module's last projection, the one that leaves the tp region
# entries a family's config plan lacks (transformers 5.x gives GPT-OSS's embedding only: its attention ran whole)
SUPPLEMENTS = {"gpt_oss": {f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")} |
               {"layers.*.self_attn.o_proj": "rowwise"},
               # transformers 4.x gives OLMoE no plan: 5.x's (q/k/v gathered for its norm over all heads)
               "olmoe": {f"layers.*.self_attn.{p}": "colwise_gather_output" for p in ("q_proj", "k_proj", "v_proj")} |
               {"layers.*.self_attn.o_proj": "rowwise_split_input"}}


def config_plan(config) -> dict:
    """A config's ``base_model_tp_plan`` with what this project supplies for its family (SUPPLEMENTS)."""
    return {**SUPPLEMENTS.get(getattr(config, "model_type", None), {}), **(getattr(config, "base_model_tp_plan", None) or {})}


class HFConfigPlan:
    """Builds a Plan from a model's ``config.base_model_tp_plan`` (found by plan="auto")."""

    name = "hf_base_model_tp_plan"
    supported = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "mla_kv_a_proj"}
    # styles whose work the plan does another way: per-head norms inside a region are found by the scan below
    # ("partial"), the input embedding is vocab-parallel
    covered = {"replicated_with_grad_allreduce", "embedding_rowwise"}

    def matches(self, module: nn.Module) -> bool:
        config = getattr(module, "config", None)
        plan = config_plan(config)
        base = _base(module)
        return (bool(plan) and base is not None and path_of(module, call_getter(module, "get_output_embeddings")) is not None
                and hasattr(getattr(module, base), "layers") and hasattr(config, "num_attention_heads")
                and hasattr(config, "hidden_size"))  # the layout build() reads (not T5Gemma's, say)

    def blocks_of(self, module: nn.Module) -> str:
        return f"{_base(module)}.layers"

    def build(self, module: nn.Module) -> Plan:
        config, base = module.config, _base(module)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        styles, parents, attrs, gathered, latent = {}, defaultdict(list), {}, set(), set()
        layers = getattr(module, base).layers
        moe = [find_moe_blocks(layer) for layer in layers]  # per layer: (path, block, family) of its MoE blocks
        tp_plan = config_plan(config)
        tp_plan = {glob: ALIASES.get(style, style) for glob, style in tp_plan.items()}
        for glob, style in tp_plan.items():
            if glob.startswith("layers.*.") and _run_by_experts(layers, moe, glob[len("layers.*."):]):
                continue
            path = f"{base}.{glob}"
            if glob.startswith("layers.*.") and not any(holds(layer, glob[len("layers.*."):]) for layer in layers):
                continue  # a layer this configuration does not build (DeepSeek-V3's q_proj where it has q_lora_rank)
            if style in self.covered:
                _check_covered(module, path, style)
                continue
            if style not in self.supported:
                raise ValueError(f"{type(module).__name__}: base_model_tp_plan style {style!r} for {glob!r} is not "
                                 f"supported yet; pass plan=lightning_tp.Plan(...) instead (docs/converting.md), or "
                                 f"use tp=1 with pp, dp, ep or zero.")
            if style == "mla_kv_a_proj":  # MLA's shared latent (and rotary key): whole on every rank, inside the
                styles[path] = "partial"  # region, its gradient summed over tp (each rank's heads read it)
                latent.add(path.rpartition(".")[0])
            elif style == "colwise_gather_output" and glob.endswith(OUTPUT_PROJECTIONS):
                # an output projection (Qwen3-Next's linear attention) reads what its module computed whole on every
                # rank: split by its input instead, its partial outputs summed (reduce-scattered under sp)
                styles[path] = {"style": "rowwise", "split_input": True}
            elif style in ("colwise", "colwise_gather_output"):
                parents[path.rpartition(".")[0]].append(path)
                if style == "colwise_gather_output" and not glob.endswith("gate_up_proj"):
                    gathered.add(path)  # whole outputs on every rank (a norm over all heads, a fused q/k/v sliced)
            elif style == "rowwise_split_input" and not _after_gate_up(tp_plan, glob):
                styles[path] = {"style": "rowwise", "split_input": True}
            else:
                styles[path] = "rowwise"
        for parent, children in parents.items():
            inner = _first_in(layers, parent.split(".*.", 1)[1], [c.rpartition(".")[2] for c in children]) \
                if ".*." in parent else None
            heads = _head_params(inner, config)
            regions = _regions(parent, children, layers, base)
            for region in regions:  # one entry into the TP region for its column layers
                styles[region] = {"style": "region", "head_params": heads} if heads else "region"
            if gathered.intersection(children):  # every head on every rank: no head counts change, no partial norm
                if not gathered.issuperset(children):
                    raise ValueError(f"{type(module).__name__}: base_model_tp_plan gathers the outputs of some of "
                                     f"{parent}'s projections but not of others; pass plan=lightning_tp.Plan(...).")
                styles.update({child: {"style": "colwise_local", "gather_output": True} for child in children})
                continue
            for child in children:
                # GPT-NeoX's fused query_key_value holds [q|k|v] per head, one after the other
                unit = head_dim if child.endswith(("q_proj", "k_proj", "v_proj")) else \
                    3 * head_dim if child.endswith("query_key_value") else 1
                if parent in latent:  # MLA: q (or q_b) in heads of qk_head_dim, kv_b in heads of k_nope + v
                    unit = inner.qk_head_dim if child.endswith(("q_proj", "q_b_proj")) else \
                        inner.qk_nope_head_dim + inner.v_head_dim
                styles[child] = {"style": "colwise_local", "unit": unit}
                if child.endswith("gate_up_proj"):  # [gate | up], chunked in two by the MLP (Phi-3)
                    styles[child]["chunks"] = 2
                if child.endswith(("k_proj", "v_proj")):  # tp > kv heads: each head copied to tp // n_kv ranks
                    styles[child]["replicate_heads"] = True
            if hasattr(inner, "num_key_value_groups"):  # read by repeat_kv: local q heads per local kv head
                rules = {"num_key_value_groups": f"kv_groups:{n_kv}"}
                # older attention classes (4.x Qwen2-MoE) reshape with their own widths and head counts
                rules.update({name: rule for name, rule in (("hidden_size", "divide"), ("num_heads", "divide"),
                                                            ("num_key_value_heads", "kv_heads"))
                              if isinstance(getattr(inner, name, None), int)})
                attrs.update({region: rules for region in regions})
            # per-head norms inside the region (Qwen3's q_norm/k_norm) see this rank's heads only
            for name, child in (inner.named_children() if inner is not None else ()):
                if type(child).__name__.endswith(("Norm", "RMSNorm", "LayerNorm")):
                    styles[f"{parent}.{name}"] = "partial"
                elif parent in latent and isinstance(child, nn.Linear) and f"{parent}.{name}" not in styles \
                        and f"{parent}.{name}" not in children:  # MLA's q_a_proj: a whole latent, as kv_a's
                    styles[f"{parent}.{name}"] = "partial"
        styles.update(norm_paths(layers[0], f"{base}.layers.*"))
        styles.update(norm_paths(getattr(module, base), base))  # the final norm, whatever its name
        styles.update({path_of(module, module.get_input_embeddings()): "vocab",
                       path_of(module, module.get_output_embeddings()): "lm_head"})
        return Plan(name=f"hf_{type(module).__name__}", styles=styles, attrs=attrs, sp_start=f"{base}.layers.*",
                    blocks=f"{base}.layers", outputs=base)


def _head_params(module, config) -> list:
    """Names of ``module``'s own parameters with one entry per attention head (GPT-OSS's ``sinks``)."""
    heads = getattr(config, "num_attention_heads", None)
    return [n for n, p in (module.named_parameters(recurse=False) if module is not None else ())
            if p.dim() == 1 and p.shape[0] == heads]


def _regions(parent: str, children: list, layers, base: str) -> list:
    """Where ``parent`` enters the tp region: its glob, or the layers that hold its column layers where others do
    not (DeepSeek-V3's dense first MLP: a region on its MoE layers' ``mlp`` would sum their replicated gradients)."""
    if ".*." not in parent:
        return [parent]
    rel = parent.split(".*.", 1)[1]
    names = [c.rpartition(".")[2] for c in children]
    held = [i for i, layer in enumerate(layers) if any(holds(layer, f"{rel}.{n}") for n in names)]
    return [parent] if len(held) == len(layers) else [f"{base}.layers.{i}.{rel}" for i in held]


def _first_in(layers, path: str, children=()):
    """The first layer's submodule at ``path`` (DeepSeek-V3's shared experts are in its MoE layers only) holding one
    of ``children`` where given (MiniMax's full attention, not its lightning attention at the same path), or None."""
    return next((layer.get_submodule(path) for layer in layers if holds(layer, path)
                 and (not children or any(holds(layer, f"{path}.{c}") for c in children))), None)


def _run_by_experts(layers, moe: list, path: str) -> bool:
    """Whether every layer holding ``path`` has it inside one of its MoE blocks (``moe[i]``: layer i's) that experts/
    runs, not tp: anywhere in a block whose forward it replaces, under ``experts`` in a transformers 5.x block (whose
    own forward runs). A dense layer's MLP at the same path (Llama 4 interleaves them) stays in the plan."""
    def inside(blocks) -> bool:
        return any(path.startswith(name + ".") and (not family.fused or path[len(name) + 1:].split(".")[0] == "experts")
                   for name, _, family in blocks)

    holding = [blocks for layer, blocks in zip(layers, moe) if holds(layer, path)]
    return bool(holding) and all(inside(blocks) for blocks in holding)


def holds(module: nn.Module, *paths: str) -> bool:
    """Whether ``module`` has a submodule at every one of ``paths``."""
    try:
        for path in paths:
            module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _after_gate_up(plan: dict, glob: str) -> bool:
    """Whether ``glob`` (a down projection) reads a fused gate_up_proj of its parent, which the plan splits in
    place (a region), so its input arrives split."""
    parent = glob.rpartition(".")[0]
    return plan.get(f"{parent}.gate_up_proj") == "colwise_gather_output"


def _check_covered(module: nn.Module, path: str, style: str) -> None:
    """A covered style must be where the plan covers it: the input embedding for ``embedding_rowwise``."""
    if style == "embedding_rowwise" and path != path_of(module, call_getter(module, "get_input_embeddings")):
        raise ValueError(f"{type(module).__name__}: base_model_tp_plan style 'embedding_rowwise' for {path!r}, which is "
                         f"not the input embedding; pass plan=lightning_tp.Plan(...) instead.")


def _base(module: nn.Module):
    """The attribute holding the base model: ``base_model_prefix``, or ``model`` where the prefix names
    another (Gemma 3's text model says ``language_model``)."""
    prefix = getattr(module, "base_model_prefix", None)
    return next((b for b in (prefix, "model") if b and isinstance(getattr(module, b, None), nn.Module)), None)


def call_getter(owner, method: str):
    """``owner.method()`` (get_input_embeddings and the like), or None where it has none."""
    try:
        return getattr(owner, method)() if owner is not None and hasattr(owner, method) else None
    except NotImplementedError:
        return None


def path_of(module: nn.Module, target):
    """Where ``target`` sits in ``module`` (the first path), or None (GPT-NeoX's head is ``embed_out``)."""
    return next((n for n, m in module.named_modules() if m is target), None) if target is not None else None


GPT2 = Plan(
    name="hf_gpt2",
    targets=("GPT2LMHeadModel",),
    requires=("transformer.h.0.attn.c_attn",),
    styles={
        "transformer.wte": "vocab",
        "transformer.h.*.attn": "region",
        "transformer.h.*.attn.c_attn": {"style": "colwise_local", "chunks": 3},
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.h.*.ln_1": "sp_norm",
        "transformer.h.*.ln_2": "sp_norm",
        # GPT2Model views its output with the input's shape, so SP ends after the last block
        "lm_head": {"style": "lm_head", "full_input": True},
    },
    attrs={"transformer.h.*.attn": {"split_size": "divide", "num_heads": "divide", "embed_dim": "divide"}},
    sp_start="transformer.drop",
    sp_end="transformer.h.*",
    blocks="transformer.h",
    outputs="transformer",
)

OPT = Plan(
    name="hf_opt",
    targets=("OPTForCausalLM",),
    requires=("model.decoder.layers.0.self_attn.q_proj",),
    styles={
        "model.decoder.embed_tokens": "vocab",
        "model.decoder.layers.*.self_attn": "region",
        "model.decoder.layers.*.self_attn.[qkv]_proj": "colwise_local",
        "model.decoder.layers.*.self_attn.out_proj": "rowwise",
        "model.decoder.layers.*.fc1": "colwise",  # on tokens flattened to 2-d: see TPContext.token_dim
        "model.decoder.layers.*.fc2": "rowwise",
        "model.decoder.layers.*.*layer_norm": "sp_norm",
        # after the blocks, on sequence shards: the final norm and OPT-350m's projection out
        "model.decoder.final_layer_norm": "sp_norm",
        "model.decoder.project_out": "sp_norm",
        "lm_head": "lm_head",
    },
    attrs={"model.decoder.layers.*.self_attn": {"num_heads": "divide", "embed_dim": "divide"}},
    sp_start="model.decoder.layers.*",
    blocks="model.decoder.layers",
    outputs="model.decoder",
)

PLANS = [GPT2, OPT, HFConfigPlan()]
