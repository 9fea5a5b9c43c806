"""Zero-bubble backward split: B computes the stage input's gradient now, W the weights' later, from the split
nodes B left (Linear and LayerNorm directly). See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .backward_phase import in_phase, input_leaves, phase  # noqa: F401 - phase, input_leaves: read by .zb_checkpoint


def _post_order(root) -> tuple[list, dict]:
    """Every node reachable from ``root``, children before parents (iterative: graphs are deep), and
    each node's children (``next_functions`` builds a fresh tuple per call: read it once)."""
    order, kids, stack = [], {}, [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in kids:
            continue
        kids[node] = children = [child for child, _ in node.next_functions if child is not None]
        stack.append((node, True))
        stack.extend((child, False) for child in children if child not in kids)
    return order, kids


class SplitBackward:
    """One microbatch's backward on one stage, cut into :meth:`input_grad` (B) and :meth:`weight_grad` (W);
    ``inp``: the received activation, None on the first stage, or a list of leaves. See
    docs/design/pipeline-run.md."""

    def __init__(self, out: torch.Tensor, grad, inp, params):
        self.out, self.grad, self.inp = out, grad, inp
        self.inputs = [inp] if isinstance(inp, torch.Tensor) else list(inp or ())
        self.params = [p for p in params if p.requires_grad]
        self.captured: dict = {}
        self.groups: list = []
        self.in_b: list = []  # groups whose weights B takes (see _fused)
        self.whole = False  # a compiled region on the input path: B runs the whole backward (see input_grad)
        self.split = self._split_nodes() if inp is not None and out.grad_fn is not None else None

    def _split_nodes(self) -> list | None:
        targets = {get_gradient_edge(i).node for i in self.inputs}
        params = {id(p): p for p in self.params}
        weights = {}  # AccumulateGrad node -> its parameter, found on the walk (one lookup per node)
        reach_in, below = {}, {}  # below: weight nodes under a weight-only node
        order, kids = _post_order(self.out.grad_fn)
        if any(type(node).__name__ == "CompiledFunctionBackward" for node in order):
            self.whole = True
            return None
        for node in order:
            children = kids[node]
            reach_in[node] = node in targets or any(reach_in[c] for c in children)
            if not reach_in[node]:
                leaf = _leaf(node)
                found = set()
                if leaf is not None and id(leaf) in params:
                    weights[node] = leaf
                    found.add(node)
                for c in children:
                    found |= below[c]
                below[node] = found
        if not reach_in[self.out.grad_fn]:
            return None  # the output does not depend on the input: all of it is weight work
        split = {}
        for node in order:
            if reach_in[node]:
                found = set().union(*(below[c] for c in kids[node] if c in below))
                if found:
                    split[node] = found
        # output side first (the walk lists children first): the last layers' gradients complete first
        self.groups = [(nodes, [weights[w] for w in ws]) for nodes, ws in _group(split)][::-1]
        # a custom Function that computes its input and weight gradients together would run twice: its
        # group's weights are taken in B, with the input (see whole_functions)
        self.in_b = [(nodes, params) for nodes, params in self.groups if any(map(_fused, nodes))]
        self.groups = [(nodes, params) for nodes, params in self.groups if not any(map(_fused, nodes))]
        self.direct = {id(nodes[0]): _direct_rule(nodes[0], params) for nodes, params in self.groups
                       if len(nodes) == 1}
        return list(split)

    def input_grad(self):
        """B: the input's gradient (None on the first stage); keeps what W needs. A stage with a compiled
        region runs its whole backward here. See docs/design/pipeline-run.md."""
        one = isinstance(self.inp, torch.Tensor)
        if self.whole:
            torch.autograd.backward(self.out, self.grad, inputs=self.inputs + self.params)
            grads = [i.grad for i in self.inputs]
            for i in self.inputs:
                i.grad = None
            self.out = self.grad = self.inp = self.inputs = None
            return grads[0] if one else grads
        if self.split is None:
            return None if one or not self.inputs else [None] * len(self.inputs)
        hooks = [n.register_prehook(lambda grads, n=n: self.captured.__setitem__(n, grads)) for n in self.split]
        with_b = [p for _, params in self.in_b for p in params]
        try:
            with in_phase("B", self.inputs, with_weights=bool(with_b)):
                grads = torch.autograd.grad(self.out, self.inputs + with_b, self.grad, retain_graph=True,
                                            allow_unused=not one or bool(with_b))
        finally:
            for h in hooks:
                h.remove()
        with torch.no_grad():
            for p, g in zip(with_b, grads[len(self.inputs):]):
                if g is not None:
                    _accumulate_one(p, g)
        grads = grads[:len(self.inputs)]
        return grads[0] if one else list(grads)

    def weight_grad(self) -> None:
        """W: accumulate the parameters' gradients into ``.grad``; frees the graph."""
        if self.whole:
            return
        with in_phase("W"):
            self._weight_grad()
        self.out = self.grad = self.inp = self.inputs = self.groups = self.direct = None
        self.captured.clear()

    def _weight_grad(self) -> None:
        if self.split is None:  # first stage (or an input-free output): the plain backward
            torch.autograd.backward(self.out, self.grad, inputs=self.params or None)
        else:
            # non-reentrant checkpointing: each saved tensor read outside one backward (the direct
            # path's) or in another backward call would recompute its block again; one group for
            # all of W recomputes each block at most once
            with _one_recompute():
                for nodes, params in self.groups:
                    rule = self.direct.get(id(nodes[0]))  # keys: the nodes of one-node groups
                    if rule is None or nodes[0] not in self.captured:
                        self._weight_group(nodes, params)
                    elif self.captured[nodes[0]][0] is not None:  # None: no gradient reached it
                        with torch.no_grad():
                            _accumulate(self.captured[nodes[0]][0], *rule)

    def _weight_group(self, nodes, params) -> None:
        """One backward per group of split nodes that share parameters, restricted to those, each node pinned
        to the gradient B saw for it. See docs/design/pipeline-run.md."""
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(self.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            return
        pins = [n.register_prehook(lambda _, saved=self.captured[n]: saved) for n in nodes if n in self.captured]
        try:
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
        finally:
            for h in pins:
                h.remove()


def _one_recompute():
    """torch.utils.checkpoint.GraphExecGroup where it exists and no group is open yet, else nothing."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group is None or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    return group()


def _leaf(node):
    """The parameter an AccumulateGrad node accumulates into, else None."""
    return getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None


def _hooked(p) -> bool:
    """A gradient hook (it may change the gradient: the engine runs it); post-accumulate-grad hooks
    only read ``.grad`` and :func:`_accumulate` runs them, as AccumulateGrad does."""
    return bool(getattr(p, "_backward_hooks", None))


def _linear(node, edges):
    """A Linear's addmm / mm: (weight, bias, gradient formula) when its weight grad is exactly ``g.t() @ x``,
    else None. See docs/design/pipeline-run.md."""
    kind = type(node).__name__
    if kind == "AddmmBackward0" and len(edges) == 3 and node._saved_alpha == 1 and node._saved_beta == 1:
        bias, t, x = _leaf(edges[0]), edges[2], "_saved_mat1"
        if bias is not None and bias.dim() != 1:  # addmm(b, x, w.t()) with a 2-d b: not a Linear's bias
            return None
    elif kind == "MmBackward0" and len(edges) == 2:
        bias, t, x = None, edges[1], "_saved_self"
    else:
        return None
    weight = _leaf(t.next_functions[0][0]) if type(t).__name__ == "TBackward0" else None
    if weight is None or weight.dim() != 2 or not weight.is_contiguous():
        return None
    return weight, bias, lambda g: (g.t().mm(getattr(node, x)), None if bias is None else g.sum(0))


def _layer_norm(node, edges):
    """LayerNorm: (weight, bias, formula) calling the kernel autograd calls, weight and bias only."""
    if type(node).__name__ != "NativeLayerNormBackward0" or len(edges) != 3:
        return None
    weight, bias = _leaf(edges[1]), _leaf(edges[2])
    if weight is None:
        return None

    def grads(g):
        _, gw, gb = torch.ops.aten.native_layer_norm_backward(
            g, node._saved_input, list(node._saved_normalized_shape), node._saved_result1, node._saved_result2,
            node._saved_weight, node._saved_bias, [False, True, bias is not None])
        return gw, gb
    return weight, bias, grads


def _direct_rule(node, params):
    """(weight, bias, formula) for a split node whose weight side is computed without the engine, or
    None. Only where its parameters are exactly the group's and carry no gradient hooks (the engine
    would run them; hooks on the AccumulateGrad nodes themselves cannot be seen and are not run)."""
    edges = [n for n, _ in node.next_functions]
    rule = _linear(node, edges) or _layer_norm(node, edges)
    if rule is None:
        return None
    found = [p for p in rule[:2] if p is not None]
    if {id(p) for p in found} != {id(p) for p in params} or any(_hooked(p) for p in found):
        return None
    return rule


def _accumulate(node_grad, weight, bias, formula) -> None:
    """The weight side of one split node, added into ``.grad`` as AccumulateGrad does (under no_grad),
    then the parameter's post-accumulate-grad hooks (e.g. the dp overlap's, see DPOverlap)."""
    for p, grad in zip((weight, bias), formula(node_grad)):
        if p is not None:
            _accumulate_one(p, grad)


def _accumulate_one(p, grad) -> None:
    if p.grad is None:
        p.grad = grad
    else:
        p.grad += grad
    for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(p)


def _fused(node) -> bool:
    """A custom autograd Function's node whose backward yields input and weight gradients in one call
    (not one of this project's, which compute each half in its phase: ``splits_backward``)."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    return not getattr(getattr(node, "_forward_cls", None), "splits_backward", False)


def whole_functions(split) -> list:
    """Names of the custom Functions whose weights a :class:`SplitBackward` takes in B (for the log)."""
    return sorted({type(n).__name__ for nodes, _ in split.in_b for n in nodes if _fused(n)})


def _group(split: dict) -> list:
    """Merge split nodes whose parameter sets overlap: ``[(nodes, weight nodes)]``, in first-seen
    order (union-find over the weight nodes: linear in the graph, not quadratic in the groups)."""
    parent = {}

    def root(w):
        while parent[w] is not w:
            parent[w] = parent[parent[w]]
            w = parent[w]
        return w

    for ws in split.values():
        first = None
        for w in ws:
            parent.setdefault(w, w)
            r = root(w)
            if first is None:
                first = r
            elif r is not first:
                parent[r] = first
    groups: dict = {}
    for node, ws in split.items():
        nodes, members = groups.setdefault(root(next(iter(ws))), ([], set()))
        nodes.append(node)
        members |= ws
    return list(groups.values())
