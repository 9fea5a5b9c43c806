"""Check that what a block is given besides its hidden states is the same on every stage: a fingerprint left in
the store by the sender, compared by the receiver, at the first runs. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
from torch.utils._pytree import tree_flatten


def _leaves(args, kwargs, hidden) -> list:
    """(place, tensor) of every tensor a block is given besides its hidden states, nested ones
    (Hugging Face's ``position_embeddings=(cos, sin)``) named by their index."""
    out = []
    for place, value in [(i, a) for i, a in enumerate(args)] + list(kwargs.items()):
        if place == hidden:
            continue
        flat, _ = tree_flatten(value)
        for j, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                out.append((f"{place!r}" if len(flat) == 1 else f"{place!r}[{j}]", t))
    return out


def fingerprint(args, kwargs, hidden) -> list:
    """Per tensor: place, shape, dtype, the sum and absolute sum of its finite values, and the count of
    those that are not (a causal mask's -inf); in float64, a chunk at a time (a long context's mask)."""
    out = []
    for place, t in _leaves(args, kwargs, hidden):
        total = torch.zeros(3, dtype=torch.float64, device=t.device)
        for part in t.detach().reshape(-1).split(1 << 22):
            d = part.to(torch.float64)
            finite = torch.isfinite(d)
            d = torch.where(finite, d, 0.0)
            total += torch.stack([d.sum(), d.abs().sum(), (~finite).sum().to(torch.float64)])
        s, a, bad = total.tolist()
        out.append([place, list(t.shape), str(t.dtype), s, a, int(bad)])
    return out


def _same(a: list, b: list) -> bool:
    if a[:3] != b[:3] or a[5] != b[5]:
        return False
    scale = max(1.0, abs(a[4]), abs(b[4]))
    return abs(a[3] - b[3]) <= 1e-6 * scale and abs(a[4] - b[4]) <= 1e-6 * scale


class SideInputCheck:
    """One per rank's pipeline: ``rank_of(vstage)`` names the rank that runs a virtual stage of this
    rank's pipeline (keys are per sending rank, so dp and tp replicas of a pipeline do not mix)."""

    made = 0  # checks made in this process; every rank makes its pipelines' in the same order

    def __init__(self, store, rank_of):
        self.store, self.rank_of, self.done = store, rank_of, set()
        SideInputCheck.made += 1
        self.number = SideInputCheck.made  # in the keys: a key an earlier pipeline left is never read

    @classmethod
    def for_mesh(cls, mesh, pp: int):
        """The check over the default process group's store, or None without one."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None
        return cls(store, lambda k: mesh.global_rank(mesh.tp_rank, mesh.dp_rank, k % pp, mesh.cp_rank))

    def __deepcopy__(self, memo):  # a copy of the model (an EMA) checks nothing more
        return self

    def _key(self, vstage: int, block: int) -> str:
        return (f"lightning_tp/side_inputs/{self.number}/{self.rank_of(vstage)}/{vstage}/{block}/"
                f"{int(torch.is_grad_enabled())}")

    def leave(self, vstage: int, block: int, args, kwargs, hidden) -> None:
        """The sending stage (``vstage``), at its last block (``block``), before running it. Once with
        grad and once without (a sanity check's validation runs first, training may give more)."""
        if ("sent", vstage, torch.is_grad_enabled()) in self.done:
            return
        self.done.add(("sent", vstage, torch.is_grad_enabled()))
        self.store.set(self._key(vstage, block), json.dumps(fingerprint(args, kwargs, hidden)))

    def compare(self, vstage: int, block: int, args, kwargs, hidden) -> None:
        """The receiving stage (``vstage``), where its code calls the previous stage's last block."""
        if ("got", vstage, torch.is_grad_enabled()) in self.done:
            return
        self.done.add(("got", vstage, torch.is_grad_enabled()))
        key = self._key(vstage - 1, block)
        try:
            self.store.wait([key], timedelta(seconds=60))  # no wait as the stages run: written before the send
            theirs = json.loads(self.store.get(key))
        except RuntimeError:  # a store that cannot answer (or ranks that made their checks apart): no check
            return
        try:
            self.store.delete_key(key)
        except (RuntimeError, NotImplementedError):  # a store without deletion keeps one small key
            pass
        mine = fingerprint(args, kwargs, hidden)
        if len(mine) != len(theirs):
            raise ValueError(f"pipeline: block {block} is given the tensors {[m[0] for m in mine]} besides its "
                             f"hidden states on stage {vstage}, but {[t[0] for t in theirs]} on stage {vstage - 1}; "
                             f"every stage runs the user's code and must give each block the same arguments.")
        for m, t in zip(mine, theirs):
            if not _same(m, t):
                raise ValueError(
                    f"pipeline: block {block} is given {m[0]} (shape {tuple(m[1])}) besides its hidden states, and "
                    f"it differs between stage {vstage - 1} (sum {t[3]:.6g}) and stage {vstage} (sum {m[3]:.6g}), "
                    f"which makes it again: only hidden states travel between stages. Made by a module that "
                    f"another stage holds (a frozen embedding's output given to every block) it is a stand-in there; "
                    f"drawn at random by a module only one stage runs it differs. Make it inside the blocks, from the batch "
                    f"or from buffers, or use tp/dp for this model.")
