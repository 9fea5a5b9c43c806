"""A plan says, for one model family, which module gets which parallel style (plain data; paths are
dotted fnmatch globs). See docs/design/plans.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Optional, Union

STYLES = {
    "colwise": "column-parallel Linear that enters the TP region itself (copy, or all-gather under SP)",
    "colwise_local": "column-parallel Linear whose input is already in the region (inside a 'region' module)",
    "rowwise": "row-parallel Linear: one all-reduce (reduce-scatter under SP) of its partial sums",
    "region": "module whose first input enters the TP region once, for all its colwise_local layers",
    "vocab": "vocab-parallel Embedding (vocab padded to a multiple of tp)",
    "embedding_cols": "Embedding split along its output: one column per head (T5's relative_attention_bias), "
                      "no communication",
    "lm_head": "column-parallel Linear over the vocabulary; gathers logits unless a 'vocab_ce' loss is planned",
    "vocab_ce": "nn.CrossEntropyLoss replaced by the vocab-parallel cross-entropy (no full logits)",
    "sp_norm": "replicated module that runs on sequence shards under SP (its grads are summed over tp)",
    "partial": "replicated module fed this rank's heads only (a per-head q/k norm): grads always summed over tp",
    "mha": "nn.MultiheadAttention replaced by a head-parallel TPMultiheadAttention",
    "replicate": "left as it is (every tp rank holds the full module)",
    "experts": "a mixture-of-experts block with a router Linear 'gate' and a list 'experts': run expert-parallel "
               "under ep (see docs/experts.md); options top_k, num_experts, router, normalize, returns_logits",
}
ATTR_RULES = {
    "divide": "value // tp (must divide)",
    "kv_heads": "a key/value head count: value // tp, or 1 when tp is a multiple of it (heads replicated)",
    "kv_groups:N": "query heads per key/value head, with N kv heads: value // (tp // N) when tp > N, else kept",
}
STYLE_OPTIONS = {
    "chunks": "the weight is that many equal blocks along its output (a fused q/k/v: 3); each is split",
    "sections": "the weight is blocks of these sizes along its output (grouped-query q/k/v); each is split",
    "unit": "outputs come in units of this size (a head's head_dim): each rank must get whole units",
    "replicate_heads": "true, or the indices of the sections/chunks holding key/value heads: with unit, a tp that "
                       "is a multiple of their head count copies each head to tp / heads ranks (Megatron's GQA)",
    "full_input": "the input is whole along the sequence even under SP (the module runs after sp_end)",
    "inputs": "for 'region': names of further arguments (by keyword or position) that enter the region too, "
              "e.g. cross-attention's key_value_states, read by its k and v",
    "whole_inputs": "for 'region' with 'inputs' (or 'mha': a cross-attention's key and value): true where those are "
                    "whole along the sequence even under SP (an encoder's output, gathered at its sp_end): they "
                    "enter by copy, as without SP",
    "top_k": "for 'experts': experts per token (an int, or the name of the block's attribute holding it)",
    "num_experts": "for 'experts': the expert count (default: len(block.experts))",
    "router": "for 'experts': 'softmax_topk' (softmax in fp32, then top-k; Mixtral's) or 'topk_softmax' (litgpt's)",
    "normalize": "for 'experts' with 'softmax_topk': renormalize the k weights to sum to 1 (default true)",
    "returns_logits": "for 'experts': the block returns (hidden states, router logits) (default false)",
    "head_params": "for 'region': names of the module's own parameters with one entry per head (GPT-OSS's attention "
                   "sinks): each rank keeps its heads' entries",
    "gather_output": "for 'colwise' and 'colwise_local': every rank gets the whole output (all-gathered; its consumer runs replicated)",
    "split_input": "for 'rowwise': the input is whole on every rank; each takes its columns first",
    "return_shards": "for 'lm_head' with 'vocab_ce': in training the model returns this rank's vocabulary "
                     "columns, not whole logits (no all-gather of tokens x vocab: for a step that reads the loss only)",
}


def as_tuple(value) -> tuple:
    """A plan field that takes one glob or path, or a tuple of them (sp_start, sp_end, outputs)."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def path_matches(pattern: str, path: str) -> bool:
    if pattern == "":
        return path == ""
    pat, parts = pattern.split("."), path.split(".") if path else []
    return len(pat) == len(parts) and all(fnmatchcase(p, q) for p, q in zip(parts, pat))


def parse_rule(rule) -> tuple | None:
    """("divide", None), ("kv_heads", None), ("kv_groups", N); None for anything else."""
    name, _, arg = str(rule).partition(":")
    if name in ("divide", "kv_heads") and not arg:
        return name, None
    if name == "kv_groups" and arg.isdigit() and int(arg) > 0:
        return name, int(arg)
    return None


def split_style(value) -> tuple:
    if isinstance(value, str):
        return value, {}
    value = dict(value)
    return value.pop("style", None), value


@dataclass
class Plan:
    """How to parallelize one model family: ``styles``, ``attrs``, ``sp_start``, ``sp_end``, ``seq_dim``,
    ``blocks``, ``outputs``, ``pipeline``, ``targets``, ``requires``, ``core``. Each field: docs/design/plans.md."""

    name: str
    styles: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    sp_start: Optional[Union[str, tuple]] = None
    sp_end: Optional[Union[str, tuple]] = None
    seq_dim: int = 1
    blocks: Optional[Union[str, tuple]] = None
    outputs: Optional[Union[str, tuple]] = None
    pipeline: bool = True
    targets: tuple = ()
    requires: tuple = ()
    core: Optional[Union[str, tuple]] = None  # activation_checkpointing="selective": what the attention core is

    def __post_init__(self):
        for glob, value in self.styles.items():
            style, options = split_style(value)
            if style not in STYLES:
                raise ValueError(f"plan {self.name!r}: unknown style {style!r} for {glob!r}; choose one of "
                                 f"{sorted(STYLES)}.")
            inputs = options.get("inputs")
            if inputs is not None and (style != "region" or isinstance(inputs, str)
                                       or not all(isinstance(n, str) for n in inputs)):
                raise ValueError(f"plan {self.name!r}: option 'inputs' of {glob!r} must be a list of argument names "
                                 f"on a 'region' style, got {inputs!r} on {style!r}.")
            if options.get("whole_inputs") and not inputs and style != "mha":
                raise ValueError(f"plan {self.name!r}: option 'whole_inputs' of {glob!r} needs 'inputs' (the arguments "
                                 f"that are whole), or the style 'mha' (its key and value).")
            if style == "experts" and options.get("router", "softmax_topk") not in ("softmax_topk", "topk_softmax"):
                raise ValueError(f"plan {self.name!r}: option 'router' of {glob!r} must be 'softmax_topk' or "
                                 f"'topk_softmax', got {options['router']!r}.")
            if style == "experts" and "top_k" not in options:
                raise ValueError(f"plan {self.name!r}: style 'experts' of {glob!r} needs the option 'top_k'.")
            unknown = set(options) - set(STYLE_OPTIONS)
            if unknown:
                raise ValueError(f"plan {self.name!r}: unknown option(s) {sorted(unknown)} for {glob!r}; choose from "
                                 f"{sorted(STYLE_OPTIONS)}.")
        for glob, rules in self.attrs.items():
            for attr, rule in rules.items():
                if parse_rule(rule) is None:
                    raise ValueError(f"plan {self.name!r}: unknown rule {rule!r} for {glob}.{attr}; choose one of "
                                     f"{sorted(ATTR_RULES)} (N an integer).")

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d.setdefault("name", "user")
        for key in ("blocks", "sp_start", "sp_end", "outputs"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        for key in ("targets", "requires"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    def sp_starts(self) -> tuple:
        """The sp_start globs, one per sequence SP splits (none without SP)."""
        return as_tuple(self.sp_start)

    def sp_ends(self) -> tuple:
        return as_tuple(self.sp_end)

    def style_of(self, path: str):
        """(style, options) of the first glob matching ``path``, or (None, {})."""
        for glob, value in self.styles.items():
            if path_matches(glob, path):
                return split_style(value)
        return None, {}

    def matches(self, module) -> bool:
        names = {c.__name__ for c in type(module).__mro__}
        if not names.intersection(self.targets):
            return False
        for path in self.requires:
            try:
                module.get_submodule(path)
            except AttributeError:
                return False
        return True
