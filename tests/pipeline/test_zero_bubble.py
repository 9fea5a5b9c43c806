"""ZB split (lightning_tp.pipeline.run.zb): B gives the input gradient, W the weight gradients, together
equal to one plain backward, and W does not run the input path again."""

import pytest
import torch
from torch import nn

from lightning_tp.pipeline.run.zb import SplitBackward


class CountBackward(torch.autograd.Function):
    """Identity that counts its backward calls (a marker on the input path)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        CountBackward.calls += 1
        return g


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Linear(2, 2)  # on this rank but not in this output's graph

    def forward(self, x):
        h = CountBackward.apply(x)
        h = self.down(CountBackward.apply(torch.relu(self.up(self.norm(h))))) + h  # marked between the layers
        return h * self.scale + self.scale  # a parameter on a branch of its own, too


def test_split_backward_equals_plain_backward_and_skips_the_input_path_in_w():
    torch.manual_seed(0)
    stage, x, g = Stage(), torch.randn(4, 8), torch.randn(4, 8)
    ref_x = x.clone().requires_grad_()
    stage(ref_x).backward(g)
    ref = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)

    CountBackward.calls = 0
    inp = x.clone().requires_grad_()
    split = SplitBackward(stage(inp), g, inp, list(stage.parameters()))
    gx = split.input_grad()
    assert CountBackward.calls == 2
    assert all(p.grad is None for p in stage.parameters()), "B must not touch weight gradients"
    torch.testing.assert_close(gx, ref_x.grad, rtol=0, atol=1e-6)
    split.weight_grad()
    assert CountBackward.calls == 2, "W ran the input path again"
    got = {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6, msg=n)


def test_first_stage_has_no_input_and_w_is_the_whole_backward():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    out = emb(torch.tensor([1, 2, 3])).sum()
    split = SplitBackward(out, None, None, list(emb.parameters()))
    assert split.input_grad() is None and emb.weight.grad is None
    split.weight_grad()
    assert emb.weight.grad[1:4].eq(1).all() and emb.weight.grad[0].eq(0).all()


def _plain_grads(run, g, params):
    """(parameter gradients, input gradient) of a plain backward of ``run()``'s (input, output);
    the parameters' ``.grad`` cleared again."""
    x, y = run()
    torch.autograd.backward(y, g)
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return ref, x.grad.clone()


class Counted(nn.Sequential):
    """Counts its forward runs (checkpoint's recomputations included)."""

    calls = 0

    def forward(self, x):
        Counted.calls += 1
        return super().forward(x)


def test_split_backward_through_non_reentrant_activation_checkpointing():
    """Blocks under torch.utils.checkpoint(use_reentrant=False): B and W recompute what they unpack
    and give a plain backward's gradients; the reentrant variant is refused by torch itself."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = nn.ModuleList(Counted(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
                           for _ in range(3))
    params, x0, g = list(blocks.parameters()), torch.randn(4, 8), torch.randn(4, 8)

    def run(reentrant):
        x = x0.clone().requires_grad_()
        y = x
        for b in blocks:
            y = y + checkpoint(b, y, use_reentrant=reentrant)
        return x, y

    ref, ref_x = _plain_grads(lambda: run(False), g, params)
    x, y = run(False)
    split = SplitBackward(y, g, x, params)
    assert torch.equal(split.input_grad(), ref_x)
    Counted.calls = 0
    split.weight_grad()  # W recomputes each checkpointed block once (its saved tensors are read by
    assert Counted.calls == len(blocks)  # several backward calls and the direct formulas: was 21)
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)
    for p in params:
        p.grad = None
    x, y = run(True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        SplitBackward(y, g, x, params).input_grad()


class Recomputed(nn.Module):
    """A block with dropout, a second input (a memory on the input path, or a bias made from an
    earlier weight: a weight-only branch), a None argument and a tuple output with a None in it."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b, self.drop = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.3)
        self.mem = nn.Linear(8, 8)

    def forward(self, x, mask, other):
        Recomputed.calls += 1
        assert mask is None
        return self.b(self.drop(torch.nn.functional.gelu(self.a(self.norm(x))))) + self.mem(other).tanh(), None


@pytest.mark.parametrize("other", ["memory", "weight_bias"])
def test_zero_bubble_checkpoint_recomputes_each_block_once_for_both_halves(other):
    """pipeline/zb_checkpoint.py: blocks recomputed in B, whose graph W reuses: a plain backward's
    gradients bit for bit (dropout's masks replayed), each block's forward run once more in all
    (torch's checkpoint: once in B, once more in W), none of it in W; a plain backward through the
    same blocks (the first stage's W) gives the same numbers."""
    from lightning_tp.pipeline.run import zb_checkpoint

    torch.manual_seed(0)
    emb = nn.Parameter(torch.randn(4, 8))
    blocks = nn.ModuleList(Recomputed() for _ in range(3))
    params = [emb] * (other == "weight_bias") + list(blocks.parameters())
    x0, g = torch.randn(4, 8), torch.randn(4, 8)

    def run(recomputed):
        torch.manual_seed(1)
        x = x0.clone().requires_grad_()
        y, side = x, (x * 1.5 if other == "memory" else emb * 2)
        for b in blocks:
            out = zb_checkpoint.checkpoint(b.forward, b, (y, None, side)) if recomputed else b(y, None, side)
            y = y + out[0]
        return x, y

    ref, ref_x = _plain_grads(lambda: run(False), g, params)
    Recomputed.calls = 0
    x, y = run(True)
    split = SplitBackward(y, g, x, params)
    assert torch.equal(split.input_grad(), ref_x)
    assert Recomputed.calls == 2 * len(blocks) and all(p.grad is None for p in params)
    split.weight_grad()
    assert Recomputed.calls == 2 * len(blocks)
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)
    for whole in (SplitBackward(run(True)[1], g, None, params), None):  # the first stage's W; a plain backward
        for p in params:
            p.grad = None
        if whole is not None:
            assert whole.input_grad() is None
            whole.weight_grad()
        else:
            torch.autograd.backward(run(True)[1], g)
        for p, r in zip(params, ref):
            assert torch.equal(p.grad, r)


class Mixed(nn.Module):
    """Linear with and without bias on 2-d and 3-d inputs, LayerNorm with and without bias."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(8), nn.LayerNorm(8, bias=False)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8)

    def forward(self, x):  # x: (2, 3, 8)
        h = self.a(self.n1(x)) + x
        h = self.b(self.n2(h)) + h
        return self.c(h.reshape(6, 8)).reshape(2, 3, 8) + h


def test_w_computes_linear_and_layer_norm_weight_grads_directly_bit_for_bit():
    """Linear and LayerNorm split nodes skip the engine in W (one backward call each would walk the
    graph below them) and still give a plain backward's gradients exactly, over two accumulated
    microbatches; a parameter with a hook keeps its node on the engine (so the hook runs)."""
    torch.manual_seed(0)
    stage = Mixed()
    params = list(stage.parameters())
    xs, gs = [torch.randn(2, 3, 8) for _ in range(2)], [torch.randn(2, 3, 8) for _ in range(2)]
    for x, g in zip(xs, gs):
        stage(x.clone().requires_grad_()).backward(g)
    ref = [p.grad.clone() for p in params]
    stage.zero_grad(set_to_none=True)
    for x, g in zip(xs, gs):
        inp = x.clone().requires_grad_()
        split = SplitBackward(stage(inp), g, inp, params)
        kinds = {type(nodes[0]).__name__ for nodes, _ in split.groups}
        assert kinds == {"AddmmBackward0", "MmBackward0", "NativeLayerNormBackward0"}, kinds
        assert all(rule is not None for rule in split.direct.values()) and len(split.direct) == 5
        split.input_grad()
        split.weight_grad()
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)

    stage.zero_grad(set_to_none=True)
    seen = []
    stage.c.weight.register_hook(lambda grad: seen.append(grad.shape))
    inp = xs[0].clone().requires_grad_()
    split = SplitBackward(stage(inp), gs[0], inp, params)
    assert sum(rule is None for rule in split.direct.values()) == 1  # c's node: its weight has a hook
    split.input_grad()
    split.weight_grad()
    assert seen == [torch.Size([8, 8])]


def test_direct_w_runs_post_accumulate_grad_hooks_as_a_plain_backward_does():
    """The dp overlap counts gradients with post-accumulate-grad hooks; W's direct formulas bypass
    AccumulateGrad, so they run those hooks themselves: once per parameter per microbatch, after
    ``.grad`` holds the sum, as a plain backward does (else ZB's dp sync could not start early)."""
    torch.manual_seed(0)
    stage = Mixed()
    params = list(stage.parameters())
    x, g = torch.randn(2, 3, 8), torch.randn(2, 3, 8)

    def run(split: bool):
        calls = []
        hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: calls.append((i, p.grad.clone())))
                 for i, p in enumerate(params)]
        try:
            for _ in range(2):  # two microbatches: the second hook call sees the accumulated sum
                inp = x.clone().requires_grad_()
                if not split:
                    stage(inp).backward(g)
                    continue
                sb = SplitBackward(stage(inp), g, inp, params)
                assert len(sb.direct) == 5 and all(r is not None for r in sb.direct.values())  # still direct
                sb.input_grad()
                sb.weight_grad()
        finally:
            for h in hooks:
                h.remove()
        grads = [p.grad.clone() for p in params]
        stage.zero_grad(set_to_none=True)
        return calls, grads

    ref_calls, ref_grads = run(split=False)
    calls, grads = run(split=True)
    # output side first, as a plain backward (the dp overlap's buckets launch last layer first):
    # per microbatch, the layers in the order their first parameter's hook fired
    layer = {id(p): name.split(".")[0] for name, p in stage.named_parameters()}
    names = [n for n, _ in stage.named_parameters()]

    def layers(order):
        out = []
        for i in order[:len(params)]:
            if layer[id(params[i])] not in out:
                out.append(layer[id(params[i])])
        return out
    assert layers([i for i, _ in calls]) == layers([i for i, _ in ref_calls]) == ["c", "b", "n2", "a", "n1"], names
    calls, ref_calls = sorted(calls, key=lambda c: c[0]), sorted(ref_calls, key=lambda c: c[0])
    assert [i for i, _ in calls] == [i for i, _ in ref_calls] == sorted(list(range(len(params))) * 2)
    for (_, a), (_, b) in zip(calls, ref_calls):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_w_does_not_run_a_hook_on_a_split_nodes_output_twice():
    """A tensor hook on a split node's output ran in B (its gradient is what B captured); W starting
    at that node must not run it again (it did for a lone node on the engine path: 2x the grad)."""
    torch.manual_seed(0)
    scale, x0, g = nn.Parameter(torch.randn(4)), torch.randn(3, 4), torch.randn(3, 4)

    def forward(x):
        h = x * scale  # MulBackward0: no direct formula, W takes the engine call
        h.register_hook(lambda grad: grad * 2)
        return h.tanh()

    x = x0.clone().requires_grad_()
    forward(x).backward(g)
    ref = scale.grad.clone()
    scale.grad = None
    x = x0.clone().requires_grad_()
    split = SplitBackward(forward(x), g, x, [scale])
    split.input_grad()
    split.weight_grad()
    assert torch.equal(scale.grad, ref)


def test_split_nodes_sharing_parameters_are_grouped_transitively():
    from lightning_tp.pipeline.run.zb import _group

    a, b, c, d, e = (object() for _ in range(5))  # weight nodes
    split = {"n1": {a}, "n2": {b}, "n3": {a, c}, "n4": {c, b}, "n5": {d}, "n6": {e, d}}
    groups = sorted((sorted(nodes), members) for nodes, members in _group(split))
    # n1-n3 share a, n3-n4 share c, n4-n2 share b: one group; n5-n6 share d
    assert groups == [(["n1", "n2", "n3", "n4"], {a, b, c}), (["n5", "n6"], {d, e})]
    assert [sorted(nodes) for nodes, _ in _group({"x": {a}, "y": {b}})] == [["x"], ["y"]]
