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


class EvalStep:
    """One forward-only step: its microbatches, the outputs not yet sent and the last stage's results."""

    def __init__(self, runner, hook: str, micro: list, rest: tuple):
        self.runner, self.hook, self.micro, self.rest = runner, hook, micro, rest
        self.logs = [[] for _ in micro]  # per microbatch: the self.log calls of its run of the user's step
        self.outputs, self.results = {}, []  # until sent; the last virtual stage's, microbatches in order

    def receiving(self, recv) -> None:
        pass

    def payload(self, send):
        return self.outputs[(send.microbatch, send.chunk)]

    def sent(self, send) -> None:
        self.outputs.pop((send.microbatch, send.chunk))

    def compute(self, a, received, transport) -> None:
        key, k = (a.microbatch, a.chunk), self.runner._vstage(a.chunk)
        send = transport.early(a)  # the output leaves where the stage stops
        finished, out = self.runner._run(
            self.hook, self.micro[a.microbatch], self.rest, k,
            with_grad_split(received.tensor, received.split, grad=False) if received is not None else None,
            self.logs[a.microbatch], received and received.wait,
            partial(transport.send, send) if send is not None else None)
        if finished:
            self.results.append(out)
        else:
            self.outputs[key] = out


class ForwardOnlyStep:
    def eval_step(self, hook: str, batch, batch_idx, rest=None):
        """validate/test/predict: the forwards of :func:`..schedule.schedules.forward_only` (a group of
        microbatches through every chunk before the next), eager or one transfer group per slot."""
        m = self._microbatches(batch, hook, batch_idx)
        rest = rest if rest is not None else ((batch_idx,), {})
        self.batch_values.start()
        step = EvalStep(self, hook, split_marked(batch, m), rest)
        device = next((b.device for b in self.module.buffers()), None) or next(self.module.parameters()).device
        if m not in self._eval_plans:
            full = forward_only(self.layout.pp, m, self.layout.v)
            slots = slot_plan(full, self.layout.pp, self.layout.v)[self.mesh.pp_rank] if self.batched else None
            self._eval_plans[m] = step_plan(full[self.mesh.pp_rank], slots, self._routes(forward_only=True))
        plan = self._eval_plans[m]
        with torch.no_grad():
            walk(plan, step, self._transport(plan, step, device, self._eval_shapes, forward_only=True))
        results = step.results
        merged = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, merge_outputs(results)) \
            if results else None
        return self._publish(step.logs, merged, train=False)
