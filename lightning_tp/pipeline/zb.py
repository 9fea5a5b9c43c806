"""Zero-bubble backward split: B computes the stage input's gradient now, W the weights' later.

ZB-H1 fills the 1F1B bubble with weight-gradient work, which only pays if W is the weight half of
the backward rather than the whole backward run a second time. The split needs no model change:
walk the stage's autograd graph from its output; a *split node* lies on the path to the stage's
input and also feeds a weight-only branch (a matmul's backward: its input gradient continues the
input path, its weight gradient leaves it). B runs the backward to the input only, and a pre-hook
keeps the gradient arriving at each split node. W runs the backward again from those nodes
(``GradientEdge``), restricted to the parameters, so each split op computes only its weight-side
outputs (PyTorch's built-in ops skip outputs nobody needs; a custom ``autograd.Function`` computes
all of its outputs again) and nothing upstream of it on the input path runs twice.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _children(node):
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(root) -> list:
    """Every node reachable from ``root``, children before parents (iterative: graphs are deep)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if child not in seen)
    return order


class SplitBackward:
    """One microbatch's backward on one stage, cut into :meth:`input_grad` (B) and :meth:`weight_grad` (W).

    ``inp``: the activation received from the previous stage (a leaf with requires_grad), or None on
    the first stage, where B has nothing to do and W is the whole backward."""

    def __init__(self, out: torch.Tensor, grad, inp, params):
        self.out, self.grad, self.inp = out, grad, inp
        self.params = [p for p in params if p.requires_grad]
        self.captured: dict = {}
        self.groups: list = []
        self.split = self._split_nodes() if inp is not None and out.grad_fn is not None else None

    def _split_nodes(self) -> list | None:
        target = get_gradient_edge(self.inp).node
        weights = {get_gradient_edge(p).node: p for p in self.params}
        reach_in, below = {}, {}  # below: weight nodes under a weight-only node
        order = _post_order(self.out.grad_fn)
        for node in order:
            kids = _children(node)
            reach_in[node] = node is target or any(reach_in[c] for c in kids)
            if not reach_in[node]:
                found = {node} if node in weights else set()
                for c in kids:
                    found |= below[c]
                below[node] = found
        if not reach_in[self.out.grad_fn]:
            return None  # the output does not depend on the input: all of it is weight work
        split = {}
        for node in order:
            if reach_in[node]:
                found = set().union(*(below[c] for c in _children(node) if c in below))
                if found:
                    split[node] = found
        self.groups = [(nodes, [weights[w] for w in ws]) for nodes, ws in _group(split)]
        return list(split)

    def input_grad(self):
        """B: the input's gradient (None on the first stage); keeps what W needs."""
        if self.split is None:
            return None
        hooks = [n.register_prehook(lambda grads, n=n: self.captured.__setitem__(n, grads)) for n in self.split]
        try:
            (g,) = torch.autograd.grad(self.out, self.inp, self.grad, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        return g

    def weight_grad(self) -> None:
        """W: accumulate the parameters' gradients into ``.grad``; frees the graph."""
        if self.split is None:  # first stage (or an input-free output): the plain backward
            torch.autograd.backward(self.out, self.grad, inputs=self.params or None)
        else:
            for nodes, params in self.groups:
                self._weight_group(nodes, params)
        self.out = self.grad = self.inp = self.groups = None
        self.captured.clear()

    def _weight_group(self, nodes, params) -> None:
        """One backward per group of split nodes that share parameters, restricted to those: the
        engine then leaves the input path alone. Within a group a node can also receive gradient
        from another one of it (``y * s + s``); a pre-hook pins every node to what B saw for it."""
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(self.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            return
        pins = [n.register_prehook(lambda _, saved=self.captured[n]: saved) for n in nodes if len(nodes) > 1
                and n in self.captured]
        try:
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
        finally:
            for h in pins:
                h.remove()


def _group(split: dict) -> list:
    """Merge split nodes whose parameter sets overlap: ``[(nodes, weight nodes)]``."""
    groups: list = []
    for node, ws in split.items():
        nodes, ws = [node], set(ws)
        for other in [g for g in groups if g[1] & ws]:
            groups.remove(other)
            nodes += other[0]
            ws |= other[1]
        groups.append((nodes, ws))
    return groups
