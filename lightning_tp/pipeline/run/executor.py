"""Run a schedule's action list inside one Lightning training step, the user's ``training_step`` once per
microbatch and stage, keeping what Lightning expects around the step. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from ...rng import backward_pass
from .backward_step import BackwardStep, no_input_grad
from ..schedule.landed import landed_after
from .logs import BatchValues, StageLogs, captured_logs, early_publish, find_metrics, muted_metrics
from .forward_only_step import ForwardOnlyStep
from ..transport.messages import with_grad_split
from .microbatch import batches_per_epoch, merge_outputs, microbatches_for, must_divide, resumable_loader, split_marked
from ..transport.p2p import Mailbox, drop_sent_values, made_early, tag
from ..transport.p2p_slots import SlotMailbox
from ..cut.placeholders import agree_on_stand_ins, holds_nan
from ..schedule.schedules import Action, build_schedule, split_keys
from ..schedule.slots import slot_plan
from .stage import StageDone, StageRun


def no_autocast(device):
    """Autocast off for a backward run inside Lightning's (mixed precision); nothing where it is off
    already (building the context costs more than the gradient's send, on its path)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


@dataclass
class _Step:
    """One training step's state: microbatches, and per (microbatch, chunk) what is in flight."""

    micro: list
    rest: tuple  # (positional, keyword) arguments of the user's step besides the batch (batch_idx, ...)
    scale: float | torch.Tensor  # the loss's factor: 1 / (microbatches * accumulation), times fp16's loss scale
    params: list
    device: torch.device
    logs: list  # per microbatch: the self.log calls of its run of the user's step
    losses: list = field(default_factory=list)
    extras: list = field(default_factory=list)  # last stage: a dict step's other keys, per microbatch
    inputs: dict = field(default_factory=dict)  # activations received (leaves that require grad)
    outputs: dict = field(default_factory=dict)  # stage outputs, until their backward
    grads: dict = field(default_factory=dict)  # output gradients received
    input_grads: dict = field(default_factory=dict)  # zero bubble: input gradients computed by B
    deferred: dict = field(default_factory=dict)  # zero bubble: the W half, until its turn
    numbers: tuple | None = None  # gloo: the posted receive of the last stage's loss and logs
    numbers_posted: bool = False
    published: tuple | None = None  # (the step's loss,) once published before the step's end
    stand_in_at: tuple | None = None  # first training step: (vstage, microbatch) of a result holding NaN
    box: Mailbox | None = None  # eager (gloo): the step's Mailbox, for sends made where a run stops
    arrivals: dict = field(default_factory=dict)  # eager: received activations' pending waits, until their F
    sent_early: set = field(default_factory=set)  # eager: (kind, microbatch, chunk) of sends made ahead of their action


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
        """Point the runner at the action lists for ``m`` microbatches and what is read off them,
        built once per m (an epoch's smaller last batch may run with fewer, see .microbatch)."""
        if m not in self._plans:
            pp, v, rank = self.layout.pp, self.layout.v, self.mesh.pp_rank
            full = build_schedule(self.schedule, pp, m, v, self.split_backward)
            actions = full[rank]
            split = split_keys(actions)  # the backwards split into B and W (zero bubble, split_backward)
            self._plans[m] = dict(
                actions=actions, split=split, receives=self._expected_receives(actions),
                slots=slot_plan(full, pp, v)[rank] if self.batched else None,
                # gloo: publish the logs before the last receive where that fills a wait (see early_publish)
                publish_at=None if self.batched else early_publish(full, pp, v)[rank],
                # gloo: per receive, the tags of the sends it proves landed, to drop them there (see ..schedule.landed)
                landed={} if self.batched else {i: [self._send_tag(actions[j]) for j in js]
                                                for i, js in landed_after(full, pp)[rank].items()},
                # each chunk's final weight-gradient pass of the step (a W, or a B not split): its gradients are
                # then final, so the dp overlap starts their sync there. Chunks finish last-first, as buckets go.
                final=_last_weight_pass(actions, split, v),
                # split: each chunk's last B, final instead where the chunk's backward is not split (see
                # BackwardStep._syncing)
                final_b=_last_per_chunk(actions, "B", v) if split else set())
        plan = self._plans[m]
        self.step_m = m  # this step's microbatch count (MegaStrategy.step_microbatches)
        self.actions, self._split, self._receives = plan["actions"], plan["split"], plan["receives"]
        self.slots, self._publish_at, self._landed = plan["slots"], plan["publish_at"], plan["landed"]
        self._final, self._final_b = plan["final"], plan["final_b"]

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

    def _expected_receives(self, actions, forward_only: bool = False) -> dict:
        """channel -> ordered [(tag, src)] of this rank's receives in one step (the Mailbox posts them ahead)."""
        out = {}
        for a in actions:
            if a.kind in ("RECV_F", "RECV_B"):
                src, t, channel = self._recv_args(a, forward_only)
                out.setdefault(channel, []).append((t, src))
        return out

    def _recv_args(self, a, forward_only: bool = False):
        """(src, tag, channel) of a RECV_F / RECV_B action; forward-only steps (validate/test/predict)
        use direction 2, apart from training's."""
        k = self._vstage(a.chunk)
        d = 2 if forward_only else (0 if a.kind == "RECV_F" else 1)
        return self._rank_of(k + 1 if d == 1 else k - 1), tag(d, a.microbatch, k, self.n_vstages), (d, k)

    def _send_route(self, a, forward_only: bool = False):
        """(dst, tag, channel) of a SEND_F / SEND_B action (direction 2: see _recv_args)."""
        k = self._vstage(a.chunk)
        d, k = ((2 if forward_only else 0), k + 1) if a.kind == "SEND_F" else (1, k - 1)
        return self._rank_of(k), tag(d, a.microbatch, k, self.n_vstages), (d, k)

    def _send_tag(self, a) -> int:
        return self._send_route(a)[1]

    def _send_args(self, a, outputs, inputs, input_grads):
        """(tensor, dst, tag, channel) of a SEND_F / SEND_B action; drops what the send was the last use of."""
        key = (a.microbatch, a.chunk)
        if a.kind == "SEND_F":
            return (outputs[key], *self._send_route(a))
        g = input_grads.pop(key) if key in input_grads else inputs[key].grad
        inputs.pop(key)
        if g is None:
            raise no_input_grad(self._vstage(a.chunk))
        return (g, *self._send_route(a))

    @staticmethod
    def _drop_sent_values(a, st) -> None:
        if a.kind == "SEND_F":
            key = (a.microbatch, a.chunk)
            drop_sent_values(st.outputs, key, st.inputs.get(key))

    @staticmethod
    def _store(a, tensor, inputs, grads, split) -> None:
        """A received activation, as the leaf its gradient is taken of (``split``: see messages.pack), or gradient."""
        key = (a.microbatch, a.chunk)
        if a.kind == "RECV_F":
            inputs[key] = with_grad_split(tensor, split)
        else:
            grads[key] = tensor

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
        st = _Step(split_marked(batch, m), rest, scale / m, params, device, [[] for _ in range(m)])
        if self.slots is None:
            self._walk_actions(st)
        else:
            self._walk_slots(st)
        for p, old in zip(params, saved):
            p._pp_fresh_grad, p.grad = p.grad, old
        self.step_extras = merge_outputs(st.extras) if st.extras else {}
        if st.published is None:
            mean_loss = float(sum(st.losses) / len(st.losses)) if st.losses else None
            st.published = (self._publish(st.logs, mean_loss, self._numbers(st)),)
        if not self._results_checked:  # after the publish: a stage waits there for the last stage's numbers
            self._results_checked = True
            if self.n_vstages > 1:  # microbatches alone (pp=1): no placeholders
                agree_on_stand_ins(st.stand_in_at, device)
        return st.published[0]

    def _walk_actions(self, st) -> None:
        """Eager (gloo): the action list in order, sends at once, receives posted ahead, sends dropped
        where a receive proves them landed."""
        box = st.box = Mailbox(self._receives, device=st.device, remembered=self._shapes)
        for i, a in enumerate(self.actions):
            if i == self._publish_at:  # a stage without the loss: it has logged all it will
                st.published = (self._publish(st.logs, None, self._numbers(st)),)
            key = (a.microbatch, a.chunk)
            if a.kind in ("RECV_F", "RECV_B"):
                self._numbers(st)  # posted with the step's other receives (see Mailbox.open)
                src, t, channel = self._recv_args(a)
                tensor, work = box.recv(src, t, st.device, channel, wait=False)
                self._store(a, tensor, st.inputs, st.grads, box.splits_in.get(channel, (0, 0)))
                arrival = partial(_arrive, work, box, self._landed.get(i, ()))
                if a.kind == "RECV_F":  # waited on at the stage's first block (StageRun.wait_for_activation)
                    st.arrivals[key] = arrival
                else:
                    arrival()
            elif a.kind in ("SEND_F", "SEND_B"):
                if not made_early(st.sent_early, a):
                    box.send(*self._send_args(a, st.outputs, st.inputs, st.input_grads))
                self._drop_sent_values(a, st)
            else:
                self._compute(a, st)
        box.wait()

    def _send_at_stop(self, box, sent: set, a, value, forward_only: bool = False) -> None:
        """SEND_F of F action ``a``'s result, made where the stage stops (see .stage.StageRun.stop) and noted
        in ``sent``: sends never block, so one made earlier than the action list says cannot deadlock,
        and a channel's microbatches still leave in order."""
        box.send(value, *self._send_route(Action("SEND_F", a.microbatch, a.chunk), forward_only))
        sent.add(("SEND_F", a.microbatch, a.chunk))

    def _send_grad_now(self, a, st) -> None:
        """SEND_B of B action ``a``'s input gradient, made as its backward returns (gloo; noted in
        ``st.sent_early``): the action list's SEND_B comes after the backward's context exits and
        the loop's turn, which lay on every gradient transfer's path (early: see _send_at_stop)."""
        send = Action("SEND_B", a.microbatch, a.chunk)
        st.box.send(*self._send_args(send, st.outputs, st.inputs, st.input_grads))
        st.sent_early.add(("SEND_B", a.microbatch, a.chunk))

    def _numbers(self, st):
        """The posted receive of the last stage's numbers (gloo, see .logs), posted at first use."""
        if not st.numbers_posted:
            st.numbers, st.numbers_posted = self._post_numbers(st.device), True
        return st.numbers

    def _walk_slots(self, st) -> None:
        """Batched (NCCL): one transfer group per time slot, see :mod:`..schedule.slots`."""
        box = SlotMailbox(self._shapes, st.device)
        for slot in self.slots:
            if slot.compute is not None:
                needed = self._input_of(slot.compute)
                if needed is not None:
                    _, t, channel = self._recv_args(needed)
                    self._store(needed, box.take(channel, t), st.inputs, st.grads, box.splits_in.get(channel, (0, 0)))
                self._compute(slot.compute, st)
            box.group([self._send_args(a, st.outputs, st.inputs, st.input_grads) for a in slot.sends],
                      [self._recv_args(a) for a in slot.recvs])
            for a in slot.sends:
                self._drop_sent_values(a, st)
        box.wait()

    def _input_of(self, a):
        """The RECV action whose tensor compute action ``a`` needs, if any."""
        k = self._vstage(a.chunk)
        if a.kind == "F" and k > 0:
            return Action("RECV_F", a.microbatch, a.chunk)
        if a.kind == "B" and k < self.n_vstages - 1:
            return Action("RECV_B", a.microbatch, a.chunk)
        return None

    def _compute(self, a, st) -> None:
        key, k = (a.microbatch, a.chunk), self._vstage(a.chunk)
        if a.kind == "F":
            early = st.box is not None and k != self.layout.last_vstage
            finished, out = self._run("training_step", st.micro[a.microbatch], st.rest, k, st.inputs.get(key),
                                      st.logs[a.microbatch], st.arrivals.pop(key, None),
                                      partial(self._send_at_stop, st.box, st.sent_early, a) if early else None)
            if finished:
                if isinstance(out, Mapping):
                    st.extras.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()
                                      if k != "loss"})
                    out = out.get("loss")
                if not isinstance(out, torch.Tensor):
                    raise ValueError(f"training_step returned {type(out).__name__} for microbatch {a.microbatch} "
                                     f"under a pipeline, which needs a loss tensor (or a dict with 'loss'); "
                                     f"skipping a batch by returning None is not supported with pp or microbatches.")
                st.losses.append(out.detach().float())
                out = out * st.scale
            if not self._results_checked and st.stand_in_at is None and holds_nan(out):
                st.stand_in_at = (k, a.microbatch)
            st.outputs[key] = out
        else:  # the step runs inside Lightning's autocast; backward must not
            # a checkpoint of the user's own recomputes blocks in here, outside any run (see stage._wrap)
            received = st.inputs.get(key) if a.kind == "B" else getattr(st.deferred.get(key), "inp", None)
            self.state.replay = (k, received)
            try:
                with no_autocast(st.device), self._syncing(a), backward_pass():
                    if a.kind == "B":
                        self._backward(key, k, st.outputs.pop(key), st.grads.pop(key, None), st.inputs,
                                       st.input_grads, st.deferred, st.params)
                        if st.box is not None and k > 0:
                            self._send_grad_now(a, st)
                    else:
                        st.deferred.pop(key).weight_grad()
            finally:
                self.state.replay = None


def _last_per_chunk(actions, kind: str, v: int) -> set:
    """Each of the ``v`` chunks' last action of ``kind`` in a rank's action list."""
    return {next(a for a in reversed(actions) if a.kind == kind and a.chunk == c) for c in range(v)}


def _last_weight_pass(actions, split: set, v: int) -> set:
    """Each chunk's last action that computes weight gradients: a W, or a B that is not split."""
    return {next(a for a in reversed(actions) if a.chunk == c and
                 (a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split))) for c in range(v)}


def _arrive(work, box, landed) -> None:
    """A receive's wait, then the release of the sends its arrival proves landed (see ..schedule.landed)."""
    work.wait()
    for sent in landed:
        box.release(sent)
