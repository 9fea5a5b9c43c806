"""Run a schedule's action list inside one Lightning training step, the user's ``training_step`` once per
microbatch and stage, keeping what Lightning expects around the step. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from functools import partial

import torch

from ...recompute.rng import backward_pass
from ..cut.placeholders import agree_on_stand_ins, holds_nan
from ..schedule.landed import landed_after
from ..schedule.schedules import build_schedule, split_keys
from ..schedule.slots import slot_plan
from ..transport.messages import with_grad_split
from ..transport.p2p import drop_sent_values
from .backward_step import BackwardStep, no_input_grad
from .forward_only_step import ForwardOnlyStep
from .logs import StageLogs, early_publish
from .loop import StepPlan, step_plan, walk
from .microbatch import MicrobatchCounts, merge_outputs, split_marked
from .transfers import Ranks, transport_for
from .user_step import UserStep


def no_autocast(device):
    """Autocast off for a backward run inside Lightning's (mixed precision); nothing where it is off
    already (building the context costs more than the gradient's send, on its path)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


class TrainingStep:
    """One training step: its microbatches, what is in flight per (microbatch, chunk), and its F, B and W (the
    runner's parts: ``user_step``, ``backward``, ``logs``, ``ranks``, ``state``)."""

    def __init__(self, runner, plan: StepPlan, micro: list, rest: tuple, scale, params: list, device,
                 check_results: bool):
        self.runner, self.plan, self.micro, self.rest = runner, plan, micro, rest
        self.check_results = check_results  # the first step: a stage result holding NaN is noted
        self.scale = scale  # the loss's factor: 1 / (microbatches * accumulation), times fp16's loss scale
        self.params, self.device = params, device
        self.logs = [[] for _ in micro]  # per microbatch: the self.log calls of its run of the user's step
        self.losses, self.extras = [], []  # last stage: per microbatch, the loss and a dict step's other keys
        self.inputs = {}  # activations received (leaves that require grad)
        self.outputs = {}  # stage outputs, until their backward
        self.grads = {}  # output gradients received
        self.input_grads = {}  # zero bubble: input gradients computed by B
        self.deferred = {}  # zero bubble: the W half, until its turn
        self.numbers, self.numbers_posted = None, False  # gloo: the posted receive of the last stage's numbers
        self.published = None  # (the step's loss,) once published before the step's end
        self.stand_in_at = None  # first training step: (vstage, microbatch) of a result holding NaN

    def receiving(self, recv) -> None:
        """Before a receive: the logs published at their point (gloo, see .logs.early_publish), the numbers'
        receive posted with the step's other receives (see ..transport.p2p.Mailbox.open)."""
        if recv == self.plan.publish_before:  # a stage without the loss: it has logged all it will
            logs = self.runner.logs
            self.published = (logs.publish(self.logs, None, self.posted_numbers(), device=self.device),)
        self.posted_numbers()

    def posted_numbers(self):
        """The posted receive of the last stage's numbers (gloo, see .logs), posted at first use."""
        if not self.numbers_posted:
            self.numbers, self.numbers_posted = self.runner.logs.post_numbers(self.device), True
        return self.numbers

    def payload(self, send):
        """What a SEND_F (the stage's output) or SEND_B (the input's gradient, dropped here) carries."""
        key = (send.microbatch, send.chunk)
        if send.kind == "SEND_F":
            return self.outputs[key]
        g = self.input_grads.pop(key) if key in self.input_grads else self.inputs[key].grad
        self.inputs.pop(key)
        if g is None:
            raise no_input_grad(self.runner.ranks.vstage(send.chunk))
        return g

    def sent(self, send) -> None:
        """At a SEND's turn: a sent output's values dropped (see ..transport.p2p.drop_sent_values)."""
        if send.kind == "SEND_F":
            key = (send.microbatch, send.chunk)
            drop_sent_values(self.outputs, key, self.inputs.get(key))

    def compute(self, a, received, transport) -> None:
        key, k = (a.microbatch, a.chunk), self.runner.ranks.vstage(a.chunk)
        if a.kind == "F":
            self._forward(a, key, k, received, transport)
            return
        if received is not None:
            self.grads[key] = received.tensor
        stage, backward = self.runner.state, self.runner.backward  # the step runs inside Lightning's autocast;
        # backward must not. A checkpoint of the user's own recomputes blocks in here, outside any run (see .stage)
        inp = self.inputs.get(key) if a.kind == "B" else getattr(self.deferred.get(key), "inp", None)
        stage.replay = (k, inp)
        try:
            with no_autocast(self.device), backward.syncing(a), backward_pass():
                if a.kind == "B":
                    backward.run(key, k, self.outputs.pop(key), self.grads.pop(key, None), self.inputs,
                                 self.input_grads, self.deferred, self.params)
                    send = transport.early(a)
                    if send is not None:  # the gradient leaves as its backward returns
                        transport.send(send)
                else:
                    self.deferred.pop(key).weight_grad()
        finally:
            stage.replay = None

    def _forward(self, a, key, k, received, transport) -> None:
        if received is not None:
            self.inputs[key] = with_grad_split(received.tensor, received.split)
        send = transport.early(a)  # the output leaves where the stage stops
        finished, out = self.runner.user_step.run(
            "training_step", self.micro[a.microbatch], self.rest, k, self.inputs.get(key), self.logs[a.microbatch],
            received and received.wait, partial(transport.send, send) if send is not None else None)
        if finished:
            if isinstance(out, Mapping):
                self.extras.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()
                                    if k != "loss"})
                out = out.get("loss")
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"training_step returned {type(out).__name__} for microbatch {a.microbatch} "
                                 f"under a pipeline, which needs a loss tensor (or a dict with 'loss'); "
                                 f"skipping a batch by returning None is not supported with pp or microbatches.")
            self.losses.append(out.detach().float())
            out = out * self.scale
        if self.check_results and self.stand_in_at is None and holds_nan(out):
            self.stand_in_at = (k, a.microbatch)
        self.outputs[key] = out


class PipelineRunner:
    """A pipeline's steps on this rank, composed of parts with their own state: where the rank is (``ranks``),
    the user's step as one stage (``user_step``), ``backward``, ``logs``, ``forward_only`` and microbatch counts."""

    def __init__(self, module, mesh, layout, state, schedule: str, microbatches: int, batched: bool = False,
                 device=None, split_backward: bool | str = False):
        self.module, self.layout, self.state = module, layout, state
        self.device = device  # where step-level tensors go (the module may still be on the CPU now)
        self.batched = batched  # NCCL: transfers grouped per time slot (see ..schedule.slots)
        self.schedule, self.m, self.split_backward = schedule, microbatches, split_backward
        self.ranks = Ranks(mesh, layout)
        self.counts = MicrobatchCounts(module, microbatches)
        self.logs = StageLogs(module, self.ranks, batched)
        self.user_step = UserStep(module, layout, state, self.logs.batch_values)
        self.backward = BackwardStep(module, layout)
        self.forward_only = ForwardOnlyStep(module, layout, self.ranks, batched, self.counts, self.user_step,
                                            self.logs)
        self._plans = {}  # microbatch count -> the training step's .loop.StepPlan
        self._shapes = {"in": {}, "out": {}}  # per P2P channel, last step's shapes (see ..transport)
        self._results_checked = False  # the first training step's stage results were checked for NaN
        self.trace = None  # an ActionTrace (see .loop) while a PipelineTimeline callback records
        self._use(microbatches)

    @property
    def mesh(self):
        return self.ranks.mesh

    @mesh.setter
    def mesh(self, mesh) -> None:  # a later strategy's groups on the same stages
        self.ranks.mesh = mesh

    @property
    def dp_overlap(self):
        """dp > 1: the strategy's DPOverlap, hooked around each chunk's final pass (see .backward_step)."""
        return self.backward.dp_overlap

    @dp_overlap.setter
    def dp_overlap(self, overlap) -> None:
        self.backward.dp_overlap = overlap

    merge_grads = staticmethod(BackwardStep.merge_grads)

    def new_run(self) -> None:
        """A new fit or evaluation on the same stages: its first batch is checked again (see must_divide)."""
        self.counts.new_run()

    def eval_step(self, hook: str, batch, batch_idx, rest=None):
        """validate/test/predict (see .forward_only_step)."""
        return self.forward_only.step(hook, batch, batch_idx, rest)

    def _device(self):
        if self.device is not None:
            return self.device
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def _use(self, m: int) -> None:
        """Point the runner at the step plan for ``m`` microbatches, built once per m (an epoch's smaller
        last batch may run with fewer, see .microbatch)."""
        if m not in self._plans:
            pp, v, rank = self.layout.pp, self.layout.v, self.ranks.mesh.pp_rank
            full = build_schedule(self.schedule, pp, m, v, self.split_backward)
            actions = full[rank]
            split = split_keys(actions)  # the backwards split into B and W (zero bubble, split_backward)
            routes = self.ranks.routes()
            publish_at = None if self.batched else early_publish(full, pp, v)[rank]
            eager = {} if self.batched else dict(
                # publish the logs before the last receive where that fills a wait (see early_publish)
                publish_before=None if publish_at is None else actions[publish_at],
                # per receive, the tags of the sends it proves landed, to drop them there (see ..schedule.landed)
                landed={actions[i]: [routes.send(actions[j])[1] for j in js]
                        for i, js in landed_after(full, pp)[rank].items()})
            self._plans[m] = step_plan(
                actions, slot_plan(full, pp, v)[rank] if self.batched else None, routes, split=split,
                # each chunk's final weight-gradient pass of the step (a W, or a B not split): its gradients are
                # then final, so the dp overlap starts their sync there. Chunks finish last-first, as buckets go.
                final=_last_weight_pass(actions, split, v),
                # split: each chunk's last B, final instead where the chunk's backward is not split (see
                # BackwardStep.syncing)
                final_b=_last_per_chunk(actions, "B", v) if split else set(), **eager)
        plan = self.plan = self._plans[m]
        self.step_m = m  # this step's microbatch count (MegaStrategy.step_microbatches)
        self.actions = plan.actions

    def train_step(self, batch, batch_idx, scale, rest=None):
        """One training step; ``scale``: the loss's factor but for the microbatches' (1 / accumulation,
        times fp16's loss scale), as their number is this batch's (see .microbatch); ``rest``: what
        the user's ``training_step`` is given besides the batch, as Lightning gave it."""
        m = self.counts.of(batch, "training_step", batch_idx)
        rest = rest if rest is not None else ((batch_idx,), {})
        self.logs.batch_values.start()
        self._use(m)
        self.backward.start(self.plan)
        params = [p for p in self.module.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        device = self._device()  # the run's device even on a stage without trainable parameters
        st = TrainingStep(self, self.plan, split_marked(batch, m), rest, scale / m, params, device,
                          not self._results_checked)
        walk(self.plan, st, transport_for(self.plan, st, self.ranks.routes(), device, self._shapes), self.trace)
        for p, old in zip(params, saved):
            p._pp_fresh_grad, p.grad = p.grad, old
        self.step_extras = merge_outputs(st.extras) if st.extras else {}
        if st.published is None:
            mean_loss = float(sum(st.losses) / len(st.losses)) if st.losses else None
            st.published = (self.logs.publish(st.logs, mean_loss, st.posted_numbers(), device=device),)
        if not self._results_checked:  # after the publish: a stage waits there for the last stage's numbers
            self._results_checked = True
            if self.ranks.n_vstages > 1:  # microbatches alone (pp=1): no placeholders
                agree_on_stand_ins(st.stand_in_at, device)
        return st.published[0]


def _last_per_chunk(actions, kind: str, v: int) -> set:
    """Each of the ``v`` chunks' last action of ``kind`` in a rank's action list."""
    return {next(a for a in reversed(actions) if a.kind == kind and a.chunk == c) for c in range(v)}


def _last_weight_pass(actions, split: set, v: int) -> set:
    """Each chunk's last action that computes weight gradients: a W, or a B that is not split."""
    return {next(a for a in reversed(actions) if a.chunk == c and
                 (a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split))) for c in range(v)}
