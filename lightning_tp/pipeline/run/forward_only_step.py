"""validate/test/predict under a pipeline: the forwards of :func:`..schedule.schedules.forward_only`, no
gradients, each stage running the user's own step on its microbatches, walked by the training step's loop
(:func:`.loop.walk`)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils._pytree import tree_map

from ..transport.messages import with_grad_split
from .loop import step_plan, walk
from .microbatch import merge_outputs, split_marked
from ..schedule.schedules import forward_only
from ..schedule.slots import slot_plan
from .transfers import transport_for


class EvalStep:
    """One forward-only step: its microbatches, the outputs not yet sent and the last stage's results."""

    def __init__(self, user_step, ranks, hook: str, micro: list, rest: tuple):
        self.user_step, self.ranks, self.hook, self.micro, self.rest = user_step, ranks, hook, micro, rest
        self.logs = [[] for _ in micro]  # per microbatch: the self.log calls of its run of the user's step
        self.outputs, self.results = {}, []  # until sent; the last virtual stage's, microbatches in order

    def receiving(self, recv) -> None:
        pass

    def payload(self, send):
        return self.outputs[(send.microbatch, send.chunk)]

    def sent(self, send) -> None:
        self.outputs.pop((send.microbatch, send.chunk))

    def compute(self, a, received, transport) -> None:
        key, k = (a.microbatch, a.chunk), self.ranks.vstage(a.chunk)
        send = transport.early(a)  # the output leaves where the stage stops
        finished, out = self.user_step.run(
            self.hook, self.micro[a.microbatch], self.rest, k,
            with_grad_split(received.tensor, received.split, grad=False) if received is not None else None,
            self.logs[a.microbatch], received and received.wait,
            partial(transport.send, send) if send is not None else None)
        if finished:
            self.results.append(out)
        else:
            self.outputs[key] = out


class ForwardOnlyStep:
    """A pipeline's forward-only steps on this rank, with their plans per microbatch count and the shapes their
    slot transfers remember across steps."""

    def __init__(self, module, layout, ranks, batched: bool, counts, user_step, logs):
        self.module, self.layout, self.ranks, self.batched = module, layout, ranks, batched
        self.counts, self.user_step, self.logs = counts, user_step, logs
        self.plans = {}  # microbatch count -> .loop.StepPlan
        self.shapes = {"in": {}, "out": {}}  # per P2P channel, last step's shapes (slots only, see ..transport)

    def step(self, hook: str, batch, batch_idx, rest=None):
        """validate/test/predict: the forwards of :func:`..schedule.schedules.forward_only` (a group of
        microbatches through every chunk before the next), eager or one transfer group per slot."""
        m = self.counts.of(batch, hook, batch_idx)
        rest = rest if rest is not None else ((batch_idx,), {})
        self.logs.batch_values.start()
        step = EvalStep(self.user_step, self.ranks, hook, split_marked(batch, m), rest)
        device = next((b.device for b in self.module.buffers()), None) or next(self.module.parameters()).device
        if m not in self.plans:
            pp, v, rank = self.layout.pp, self.layout.v, self.ranks.mesh.pp_rank
            full = forward_only(pp, m, v)
            self.plans[m] = step_plan(full[rank], slot_plan(full, pp, v)[rank] if self.batched else None,
                                      self.ranks.routes(forward_only=True))
        plan = self.plans[m]
        with torch.no_grad():  # eager: no shapes guessed (see ..transport.p2p.Mailbox)
            walk(plan, step, transport_for(plan, step, self.ranks.routes(forward_only=True), device,
                                           self.shapes if plan.slots is not None else None))
        results = step.results
        merged = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, merge_outputs(results)) \
            if results else None
        return self.logs.publish(step.logs, merged, train=False)
