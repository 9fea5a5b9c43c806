"""What a model must offer context parallelism, checked before any collective: attention through
torch's scaled_dot_product_attention, and positions the strategy can follow."""

from __future__ import annotations

from torch import nn

WORKS = "'sdpa' (torch's scaled_dot_product_attention)"


def check_model(module: nn.Module, cp: int) -> None:
    """An error naming the module for a Hugging Face model on another attention implementation, and for
    litgpt (its rotary tables are read by length, so positions cannot follow the tokens)."""
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and impl != "sdpa":
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} ({type(sub).__name__}) runs "
                             f"attn_implementation={impl!r}; context parallelism replaces {WORKS} only. Load or "
                             f"build the model with attn_implementation='sdpa'.")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} ({type(sub).__name__}) uses "
                             f"sliding-window attention (sliding_window={window}), which context-parallel attention "
                             f"does not apply (each rank would see a local window). Set sliding_window=None in its "
                             f"config if your sequences are shorter than the window, or use cp=1.")
        if getattr(config, "attention_sink", None) is not None or type(sub).__name__.startswith("GptOss"):
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} ({type(sub).__name__}) has "
                             f"attention sinks, which context-parallel attention would drop; use cp=1.")
        if type(sub).__module__.startswith("litgpt"):
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} is a litgpt model, whose "
                             f"rotary tables are sliced by sequence length, so a cp rank's chunks would get the "
                             f"first positions. Context parallelism is not supported for litgpt models yet.")
        if type(sub).__name__.endswith(("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice")):
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} ({type(sub).__name__}) reads one "
                             f"position of each sequence (a pooled token or a span), which lives on one cp rank "
                             f"only; context parallelism supports per-token heads (causal LM, token classification).")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"MegaStrategy(cp={cp}): {name or type(module).__name__} is an encoder-decoder; "
                             f"context parallelism supports decoder-only and encoder-only self-attention.")
