"""Run a schedule's action list inside one Lightning training step, the user's ``training_step`` once per
microbatch and stage, keeping what Lightning expects around the step. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from functools import partial

import torch

from ...rng import backward_pass
from .backward_step import BackwardStep, no_input_grad
from ..schedule.landed import landed_after
from .logs import BatchValues, StageLogs, captured_logs, early_publish, find_metrics, muted_metrics
from .forward_only_step import ForwardOnlyStep
from ..transport.messages import with_grad_split
from .microbatch import batches_per_epoch, merge_outputs, microbatches_for, must_divide, resumable_loader, split_marked
from ..transport.p2p import Mailbox, drop_sent_values
from ..transport.p2p_slots import SlotMailbox
from ..cut.placeholders import agree_on_stand_ins, holds_nan
from ..schedule.schedules import build_schedule, split_keys
from ..schedule.slots import slot_plan
from .stage import StageDone, StageRun
from .loop import StepPlan, step_plan, walk
from .transfers import ListTransport, Routes, SlotTransport


def no_autocast(device):
    """Autocast off for a backward run inside Lightning's (mixed precision); nothing where it is off
    already (building the context costs more than the gradient's send, on its path)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


class TrainingStep:
    """One training step: its microbatches, what is in flight per (microbatch, chunk), and its F, B and W."""

    def __init__(self, runner, plan: StepPlan, micro: list, rest: tuple, scale, params: list, device):
        self.runner, self.plan, self.micro, self.rest = runner, plan, micro, rest
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
            self.published = (self.runner._publish(self.logs, None, self.posted_numbers()),)
        self.posted_numbers()

    def posted_numbers(self):
        """The posted receive of the last stage's numbers (gloo, see .logs), posted at first use."""
        if not self.numbers_posted:
            self.numbers, self.numbers_posted = self.runner._post_numbers(self.device), True
        return self.numbers

    def payload(self, send):
        """What a SEND_F (the stage's output) or SEND_B (the input's gradient, dropped here) carries."""
        key = (send.microbatch, send.chunk)
        if send.kind == "SEND_F":
            return self.outputs[key]
        g = self.input_grads.pop(key) if key in self.input_grads else self.inputs[key].grad
        self.inputs.pop(key)
        if g is None:
            raise no_input_grad(self.runner._vstage(send.chunk))
        return g

    def sent(self, send) -> None:
        """At a SEND's turn: a sent output's values dropped (see ..transport.p2p.drop_sent_values)."""
        if send.kind == "SEND_F":
            key = (send.microbatch, send.chunk)
            drop_sent_values(self.outputs, key, self.inputs.get(key))

    def compute(self, a, received, transport) -> None:
        key, k = (a.microbatch, a.chunk), self.runner._vstage(a.chunk)
        if a.kind == "F":
            self._forward(a, key, k, received, transport)
            return
        if received is not None:
            self.grads[key] = received.tensor
        runner = self.runner  # the step runs inside Lightning's autocast; backward must not
        # a checkpoint of the user's own recomputes blocks in here, outside any run (see stage._wrap)
        inp = self.inputs.get(key) if a.kind == "B" else getattr(self.deferred.get(key), "inp", None)
        runner.state.replay = (k, inp)
        try:
            with no_autocast(self.device), runner._syncing(a), backward_pass():
                if a.kind == "B":
                    runner._backward(key, k, self.outputs.pop(key), self.grads.pop(key, None), self.inputs,
                                     self.input_grads, self.deferred, self.params)
                    send = transport.early(a)
                    if send is not None:  # the gradient leaves as its backward returns
                        transport.send(send)
                else:
                    self.deferred.pop(key).weight_grad()
        finally:
            runner.state.replay = None

    def _forward(self, a, key, k, received, transport) -> None:
        runner = self.runner
        if received is not None:
            self.inputs[key] = with_grad_split(received.tensor, received.split)
        send = transport.early(a)  # the output leaves where the stage stops
        finished, out = runner._run("training_step", self.micro[a.microbatch], self.rest, k, self.inputs.get(key),
                                    self.logs[a.microbatch], received and received.wait,
                                    partial(transport.send, send) if send is not None else None)
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
        if not runner._results_checked and self.stand_in_at is None and holds_nan(out):
            self.stand_in_at = (k, a.microbatch)
        self.outputs[key] = out


class PipelineRunner(StageLogs, ForwardOnlyStep, BackwardStep):
    def __init__(self, module, mesh, layout, state, schedule: str, microbatches: int, batched: bool = False,
                 device=None, split_backward: bool | str = False):
        self.module, self.mesh, self.layout, self.state = module, mesh, layout, state
        self.device = device  # where step-level tensors go (the module may still be on the CPU now)
        self.batched = batched  # NCCL: transfers grouped per time slot (see ..schedule.slots)
        self.schedule, self.m, self.split_backward = schedule, microbatches, split_backward
        self.n_vstages = layout.pp * layout.v
        self.dp_overlap = None  # dp > 1: the strategy's DPOverlap, hooked around self._final (see _syncing)
        self._plans, self._eval_plans, self._warned = {}, {}, set()
        self._whole_chunks = set()  # zero bubble: chunks whose backward B runs whole (compiled blocks, see .zb)
        self._trained = False  # a training step ran (the first of a run is checked, see must_divide)
        self._results_checked = False  # the first training step's stage results were checked for NaN
        self._use(microbatches)
        self._log_names = None  # the last stage's logged names as of the previous step (see _share_numbers)
        self._metrics = None  # torchmetrics modules of the user's module (muted in all but the last chunk)
        self.batch_values = BatchValues()  # their step values over the microbatches
        self._shapes = {"in": {}, "out": {}}  # per P2P channel, last step's shapes (see Mailbox)
        self._eval_shapes = {"in": {}, "out": {}}  # the same for forward-only steps in slots (NCCL)

    def new_run(self) -> None:
        """A new fit or evaluation on the same stages: its first batch is checked again (see must_divide)."""
        self._trained = False

    # ---------------------------------------------------------------- helpers

    def _rank_of(self, vstage: int) -> int:
        return self.mesh.global_rank(self.mesh.tp_rank, self.mesh.dp_rank, vstage % self.layout.pp)

    def _vstage(self, chunk: int) -> int:
        return chunk * self.layout.pp + self.mesh.pp_rank

    def _routes(self, forward_only: bool = False) -> Routes:
        return Routes(self._rank_of, self._vstage, self.n_vstages, forward_only)

    def _transport(self, plan: StepPlan, step, device, remembered, forward_only: bool = False):
        """The step's transport: eager over the action list (gloo), else one group per time slot."""
        routes = self._routes(forward_only)
        if plan.slots is None:  # a forward-only step guesses no shapes (see Mailbox)
            box = Mailbox(plan.expected, device=device, remembered=None if forward_only else remembered)
            return ListTransport(plan, step, routes, box, device)
        return SlotTransport(plan, step, routes, SlotMailbox(remembered, device))

    def _run(self, hook: str, micro, rest, vstage, received, logs, arrival=None, on_stop=None):
        """The user's step on one microbatch as virtual stage ``vstage``: (ran to its end, its result or
        what the stage hands on). ``arrival``: the wait for ``received``'s values, left to the stage's
        first block; ``on_stop``: sends what the stage hands on, where it stops (see .stage.StageRun)."""
        run = self.state.run = StageRun(vstage, received, activation_wait=arrival, send_at_stop=on_stop)
        mute = vstage // self.layout.pp < self.layout.v - 1
        try:
            if self._metrics is None:  # looked up once: walking the module per microbatch adds up
                self._metrics = find_metrics(self.module)
            step = getattr(self.module, hook)
            with captured_logs(self.module, logs):
                if self._metrics:
                    with muted_metrics(self._metrics, mute), self.batch_values.recording([] if mute else self._metrics):
                        out = step(micro, *rest[0], **rest[1])
                else:  # no torchmetrics: two contexts less on the pipeline's critical path
                    out = step(micro, *rest[0], **rest[1])
            if vstage != self.layout.last_vstage:
                nxt = self.layout.ranges[vstage][1] + 1
                raise ValueError(f"pipeline: {hook} ran to its end on virtual stage {vstage} without calling block "
                                 f"{nxt} (the next stage's first), where this stage hands its activation on. Every "
                                 f"stage runs your step: it must call every block, in order, on every batch.")
            result = True, out
        except StageDone as done:
            result = False, done.output
        except BaseException:
            run.activation_wait = None  # a failing step: not waited on
            raise
        finally:
            run.activation, run.replaced, run.passed_through, run.send_at_stop = None, {}, None, None
        run.wait_for_activation()  # a run that never reached its first block
        return result

    def _device(self):
        if self.device is not None:
            return self.device
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def _use(self, m: int) -> None:
        """Point the runner at the step plan for ``m`` microbatches, built once per m (an epoch's smaller
        last batch may run with fewer, see .microbatch)."""
        if m not in self._plans:
            pp, v, rank = self.layout.pp, self.layout.v, self.mesh.pp_rank
            full = build_schedule(self.schedule, pp, m, v, self.split_backward)
            actions = full[rank]
            split = split_keys(actions)  # the backwards split into B and W (zero bubble, split_backward)
            routes = self._routes()
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
                # BackwardStep._syncing)
                final_b=_last_per_chunk(actions, "B", v) if split else set(), **eager)
        plan = self.plan = self._plans[m]
        self.step_m = m  # this step's microbatch count (MegaStrategy.step_microbatches)
        self.actions, self._split = plan.actions, plan.split

    def _microbatches(self, batch, hook: str, batch_idx: int) -> int:
        """This batch's microbatch count (see .microbatch), warning once per hook when it is not m."""
        first_of_run = not self._trained and not resumable_loader(self.module)
        m = microbatches_for(batch, self.m, strict=must_divide(hook, batch_idx, first_of_run,
                                                               batches_per_epoch(self.module)))
        self._trained = self._trained or hook == "training_step"
        if m != self.m and hook not in self._warned:
            from lightning.pytorch.utilities import rank_zero_warn

            self._warned.add(hook)
            rank_zero_warn(f"{hook}: a batch that microbatches={self.m} does not divide (an epoch's smaller last "
                           f"batch?) runs as {m} microbatches, none larger than usual (warned once).")
        return m

    # ---------------------------------------------------------------- training

    def train_step(self, batch, batch_idx, scale, rest=None):
        """One training step; ``scale``: the loss's factor but for the microbatches' (1 / accumulation,
        times fp16's loss scale), as their number is this batch's (see .microbatch); ``rest``: what
        the user's ``training_step`` is given besides the batch, as Lightning gave it."""
        m = self._microbatches(batch, "training_step", batch_idx)
        rest = rest if rest is not None else ((batch_idx,), {})
        self.batch_values.start()
        self._use(m)
        if self.dp_overlap is not None:
            self.dp_overlap.restart()  # a step that raised may have left a count behind
        params = [p for p in self.module.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        device = self._device()  # the run's device even on a stage without trainable parameters
        st = TrainingStep(self, self.plan, split_marked(batch, m), rest, scale / m, params, device)
        walk(self.plan, st, self._transport(self.plan, st, device, self._shapes))
        for p, old in zip(params, saved):
            p._pp_fresh_grad, p.grad = p.grad, old
        self.step_extras = merge_outputs(st.extras) if st.extras else {}
        if st.published is None:
            mean_loss = float(sum(st.losses) / len(st.losses)) if st.losses else None
            st.published = (self._publish(st.logs, mean_loss, st.posted_numbers()),)
        if not self._results_checked:  # after the publish: a stage waits there for the last stage's numbers
            self._results_checked = True
            if self.n_vstages > 1:  # microbatches alone (pp=1): no placeholders
                agree_on_stand_ins(st.stand_in_at, device)
        return st.published[0]


def _last_per_chunk(actions, kind: str, v: int) -> set:
    """Each of the ``v`` chunks' last action of ``kind`` in a rank's action list."""
    return {next(a for a in reversed(actions) if a.kind == kind and a.chunk == c) for c in range(v)}


def _last_weight_pass(actions, split: set, v: int) -> set:
    """Each chunk's last action that computes weight gradients: a W, or a B that is not split."""
    return {next(a for a in reversed(actions) if a.chunk == c and
                 (a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split))) for c in range(v)}
