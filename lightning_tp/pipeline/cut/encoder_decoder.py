"""An encoder-decoder's two block lists as one chain of pipeline stages (encoder first): which lists,
checked. See docs/design/pipeline-cut.md.
"""

from __future__ import annotations

import inspect

from torch import nn

from .block_lists import block_at, find_blocks, is_block_list
from .outer_modules import holds_linear, outer_groups


def takes_encoder_output(block: nn.Module) -> bool:
    """Whether a block's forward takes a second tensor: two required positional parameters, ``*args``,
    or a parameter after the first named for the encoder's output."""
    params = list(inspect.signature(block.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (sum(p.default is p.empty for p in positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
            or any(("memory" in p.name or "encoder" in p.name) and p.kind != p.VAR_KEYWORD for p in params[1:]))


def find_encoder_decoder(model: nn.Module):
    """The paths of an encoder-decoder's two outermost block lists when the model says it is one
    (nn.TransformerDecoderLayer blocks, or a Hugging Face config's ``is_encoder_decoder``), else None.
    See docs/design/pipeline-cut.md."""
    found = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in found):
            continue
        if is_block_list(module, others=False) and any(p.requires_grad for p in module.parameters()):
            found.append(path)
    if len(found) != 2:
        return None
    said = isinstance(model.get_submodule(found[1])[0], nn.TransformerDecoderLayer) or any(
        getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True for m in model.modules())
    return tuple(found) if said and takes_encoder_output(model.get_submodule(found[1])[0]) else None


def encoder_decoder(model: nn.Module, names, pp: int) -> tuple:
    """((path, length), (path, length)) of an encoder-decoder's two block lists, checked, and whether its
    head shares the embedding's weight."""
    if len(names) != 2:
        raise ValueError(f"pipeline_blocks={list(names)}: name one block list, or an encoder-decoder's two "
                         f"(encoder first, then decoder).")
    found = [find_blocks(model, n) for n in names]
    (encoder, _), (decoder, blocks) = found
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    if encoder == decoder or encoder.startswith(decoder + ".") or decoder.startswith(encoder + ".") \
            or order[encoder] > order[decoder]:
        raise ValueError(f"pipeline_blocks={list(names)}: an encoder-decoder's two lists must be apart, the "
                         f"encoder's registered first, as they run.")
    if not takes_encoder_output(block_at(blocks, 0)):
        raise ValueError(f"pipeline_blocks={list(names)}: two block lists are taken as an encoder and a decoder "
                         f"whose blocks take the encoder's output (as "
                         f"nn.TransformerDecoderLayer does), but the blocks of {decoder} take one tensor. Name "
                         f"one block list, or use tp/dp for this model.")
    lists = tuple((path, len(b)) for path, b in found)
    groups = outer_groups(model, [p for p, _ in lists])
    first = {id(p) for _, m in groups["before"] for p in m.parameters()}
    if pp > 1 and any(id(p) in first for kind in ("between", "decoder_in") for _, m in groups[kind]
                      for p in m.parameters()):
        raise ValueError(f"pipeline_blocks={list(names)}: a module between the encoder and the decoder shares "
                         f"weights with the embedding; that is not supported under pp.")
    bridges = [name for name, m in groups["between"] if holds_linear(m)]
    if pp > 1 and bridges and not any(holds_linear(m) for _, m in groups["after"]):
        raise ValueError(f"{bridges} lie between the encoder and the decoder, so they run where the encoder ends, "
                         f"and no Linear comes after the decoder: if one of them is the output head, register it "
                         f"after the decoder.")
    return lists, any(id(p) in first for _, m in groups["after"] for p in m.parameters())

