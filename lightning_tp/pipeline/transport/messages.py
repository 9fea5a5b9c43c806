"""One message of several tensors, what a stage of an encoder-decoder hands on (see :mod:`..run.stage`): packed
into one flat tensor, the parts that take a gradient first. See docs/design/pipeline-transport.md.
"""

from __future__ import annotations

import torch


def pack(parts: list) -> torch.Tensor:
    """One flat message of a stage's tensors; where only some need a gradient, those go first and the message
    says so (``_lightning_tp_grad_split``, see p2p.grad_split). See docs/design/pipeline-transport.md."""
    if len(parts) == 1:
        return parts[0]
    if len({p.dtype for p in parts}) > 1:
        raise ValueError(f"pipeline: a stage sends tensors of dtypes {[p.dtype for p in parts]} together; they "
                         f"travel as one message and must share a dtype.")
    needs = [p.requires_grad for p in parts]
    if all(needs) or not any(needs):
        return torch.cat([p.reshape(-1) for p in parts])
    order = [p for p in parts if p.requires_grad] + [p for p in parts if not p.requires_grad]
    message = torch.cat([p.reshape(-1) for p in order])
    message._lightning_tp_grad_split = (sum(1 << i for i, n in enumerate(needs) if n),
                                        sum(p.numel() for p in parts if p.requires_grad))
    return message


def with_grad_split(message: torch.Tensor, split: tuple, grad: bool = True) -> torch.Tensor:
    """What a receiver takes the gradient of (``grad``; a forward-only step: none): the whole received
    ``message``, or with a grad split (see pack) its leading values only, a leaf whose
    ``_lightning_tp_whole`` is the message and the split (unpack reads them)."""
    parts, numel = split
    if not parts:
        return message.requires_grad_() if grad else message
    leaf = message[:numel].detach().requires_grad_(grad)
    leaf._lightning_tp_whole = (message, parts)
    return leaf


def unpack(message: torch.Tensor, like: list) -> list:
    """Split a packed message into tensors shaped like ``like`` (what this stage's code computed);
    a message with a grad split (see with_grad_split) gives views of its gradient-taking leaf for the
    parts that need one, of the rest of the message for the others."""
    whole, parts = getattr(message, "_lightning_tp_whole", (message, 0))
    if len(like) == 1 and not parts:
        return [message.view(like[0].shape)]
    sizes = [t.numel() for t in like]
    if whole.numel() != sum(sizes) or parts >> len(like):
        raise ValueError(f"pipeline: received {whole.numel()} values for tensors of shapes "
                         f"{[tuple(t.shape) for t in like]}; every stage must see the same batch shapes.")
    if not parts:
        return [part.view(t.shape) for part, t in zip(message.split(sizes), like)]
    needs = [i for i in range(len(like)) if parts >> i & 1]
    rest = [i for i in range(len(like)) if not parts >> i & 1]
    if sum(sizes[i] for i in needs) != message.numel():
        raise ValueError(f"pipeline: received {message.numel()} values needing a gradient for tensors of shapes "
                         f"{[tuple(like[i].shape) for i in needs]}; every stage must see the same batch shapes.")
    out = [None] * len(like)
    for i, part in zip(needs, message.split([sizes[i] for i in needs])):
        out[i] = part.view(like[i].shape)
    for i, part in zip(rest, whole[message.numel():].split([sizes[i] for i in rest])):
        out[i] = part.view(like[i].shape)
    return out
