"""validate/test/predict under a pipeline: the forwards of :func:`..schedule.schedules.forward_only`, no
gradients, each stage running the user's own step on its microbatches (see :mod:`.executor`, whose
runner this is a part of: it provides ``_run``, the transfer routes and the log publishing)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils._pytree import tree_map

from ..transport.messages import with_grad_split
from .microbatch import merge_outputs, split_marked
from ..transport.p2p import Mailbox, made_early
from ..transport.p2p_slots import SlotMailbox
from ..schedule.schedules import forward_only
from ..schedule.slots import slot_plan


class ForwardOnlyStep:
    def eval_step(self, hook: str, batch, batch_idx, rest=None):
        """validate/test/predict: the forwards of :func:`..schedule.schedules.forward_only` (a group of
        microbatches through every chunk before the next), eager or one transfer group per slot."""
        m = self._microbatches(batch, hook, batch_idx)
        rest = rest if rest is not None else ((batch_idx,), {})
        self.batch_values.start()
        micro, logs, results, received, outputs = split_marked(batch, m), [[] for _ in range(m)], [], {}, {}
        device = next((b.device for b in self.module.buffers()), None) or next(self.module.parameters()).device
        if m not in self._eval_plans:
            full = forward_only(self.layout.pp, m, self.layout.v)
            slots = slot_plan(full, self.layout.pp, self.layout.v) if self.batched else None
            actions = full[self.mesh.pp_rank]
            self._eval_plans[m] = (actions, slots and slots[self.mesh.pp_rank],
                                   self._expected_receives(actions, forward_only=True))
        actions, slots, expected = self._eval_plans[m]

        # eager: a received activation's wait until its stage's first block, and the outputs sent where
        # their run stopped (as in training, see executor._walk_actions)
        arrivals, sent = {}, set()

        def forward(a, box=None):
            key, k = (a.microbatch, a.chunk), self._vstage(a.chunk)
            early = box is not None and k != self.layout.last_vstage
            finished, out = self._run(hook, micro[a.microbatch], rest, k, received.pop(key, None), logs[a.microbatch],
                                      arrivals.pop(key, None),
                                      partial(self._send_at_stop, box, sent, a, forward_only=True) if early else None)
            if finished:
                results.append(out)  # the last virtual stage takes microbatches in order
            else:
                outputs[key] = out

        with torch.no_grad():
            if slots is None:
                box = Mailbox(expected, device=device)
                for a in actions:
                    key = (a.microbatch, a.chunk)
                    if a.kind == "RECV_F":
                        src, t, channel = self._recv_args(a, forward_only=True)
                        message, work = box.recv(src, t, device, channel, wait=False)
                        received[key] = with_grad_split(message, box.splits_in.get(channel, (0, 0)), grad=False)
                        arrivals[key] = work.wait
                    elif a.kind == "SEND_F":
                        out = outputs.pop(key)
                        if not made_early(sent, a):
                            box.send(out, *self._send_route(a, forward_only=True))
                    else:
                        forward(a, box)
            else:
                box = SlotMailbox(self._eval_shapes, device)
                for slot in slots:
                    if slot.compute is not None:
                        a = slot.compute
                        if self._vstage(a.chunk) > 0:
                            _, t, channel = self._recv_args(a, forward_only=True)
                            received[(a.microbatch, a.chunk)] = with_grad_split(
                                box.take(channel, t), box.splits_in.get(channel, (0, 0)), grad=False)
                        forward(a)
                    box.group([(outputs.pop((a.microbatch, a.chunk)), *self._send_route(a, forward_only=True))
                               for a in slot.sends], [self._recv_args(a, forward_only=True) for a in slot.recvs])
        box.wait()
        merged = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, merge_outputs(results)) \
            if results else None
        return self._publish(logs, merged, train=False)
