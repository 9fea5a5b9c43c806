"""How a pipelined step's loss and ``self.log`` values reach every stage: captured per microbatch, reduced on
the last stage, logged on every stage (:class:`StageLogs`). See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ..transport.p2p import tag
from ..schedule.simulate import simulate


class captured_logs:
    """Collect self.log calls instead of sending them to Lightning (once per microbatch), tensors detached; set
    in the instance's ``__dict__`` directly (speed). See docs/design/pipeline-run.md."""

    def __init__(self, module, sink: list):
        self.module, self.sink = module, sink

    def __enter__(self):
        sink = self.sink
        self.module.__dict__["log"] = lambda name, value, *args, **kwargs: sink.append(
            (name, value.detach() if isinstance(value, torch.Tensor) else value, args, kwargs))

    def __exit__(self, *exc):
        self.module.__dict__.pop("log", None)


def find_metrics(module) -> list:
    return [m for m in module.modules() if hasattr(m, "update") and hasattr(m, "compute")]


@contextmanager
def muted_metrics(metrics: list, mute: bool):
    """With several chunks per rank the user's step runs once per chunk; torchmetrics updates
    count in the last chunk's run only, so a metric sees every sample once."""
    saved = [(m, m.__dict__.get("update")) for m in (metrics if mute else [])]
    for m, _ in saved:
        m.update = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for m, own in saved:  # torchmetrics wraps update on the instance (its update count, its cache reset)
            if own is None:
                del m.update
            else:
                m.update = own


class BatchValues:
    """A logged torchmetrics Metric's step value over the whole batch: each microbatch's forward inputs also go
    to a copy of the metric, reset every step, whose value becomes the step value. See
    docs/design/pipeline-run.md."""

    def __init__(self):
        self.copies, self.used = {}, {}

    def start(self) -> None:
        for _, copy_ in self.used.values():
            copy_.reset()
        self.used = {}

    @contextmanager
    def recording(self, metrics: list):
        metrics = [m for m in metrics if hasattr(m, "_forward_cache") and "forward" not in m.__dict__]
        for m in metrics:
            m.forward = self._forward(m, m.forward)
        try:
            yield
        finally:
            for m in metrics:
                del m.forward

    def _forward(self, metric, forward):
        def recorded(*args, **kwargs):
            copy_ = self.copies.get(id(metric))
            if copy_ is None:
                group = getattr(metric, "process_group", None)  # a process group is not copied
                copy_ = self.copies[id(metric)] = copy.deepcopy(metric, {id(group): group})
                copy_.reset()  # its value syncs over dp as the forward's would: only with dist_sync_on_step
                copy_.sync_on_compute = copy_._to_sync = bool(getattr(metric, "dist_sync_on_step", False))
            self.used[id(metric)] = (metric, copy_)
            copy_.update(*args, **kwargs)
            return forward(*args, **kwargs)
        return recorded

    def finish(self) -> None:
        for metric, copy_ in self.used.values():
            metric._forward_cache = copy_.compute()


def early_publish(schedule, p: int, v: int = 1) -> list:
    """Per rank: the index of the action before which it can publish the step's logs (before its last receive,
    where that cannot hang or wait), or None (at step end). See docs/design/pipeline-run.md."""
    res = simulate(schedule, p, v)
    last_end = max((end for _, end, _ in res.timelines[p - 1]), default=0)
    points = []
    for r, ops in enumerate(schedule):
        recvs = [i for i, a in enumerate(ops) if a.kind in ("RECV_F", "RECV_B")]
        at = recvs[-1] if recvs else None
        if r == p - 1 or at is None or any(a.kind == "F" for a in ops[at:]) or (r and points[-1] is None):
            points.append(None)
            continue
        kind, chunk = ops[at].kind, ops[at].chunk
        if not any(ops[i].kind == kind and ops[i].chunk == chunk for i in recvs[:-1]):
            points.append(None)  # the first message of its channel
            continue
        done = sum(1 for a in ops[:at] if a.kind in ("F", "B", "W"))  # compute actions before it
        reached = res.timelines[r][done - 1][1] if done else 0
        points.append(at if reached >= last_end else None)
    return points


_REDUCE = {"mean": lambda v: sum(v) / len(v), "sum": sum, "max": max, "min": min}


def _reduce(values, args, kwargs):
    """One step's value from its microbatches' by the call's ``reduce_fx`` (Lightning's: mean, sum,
    max, min), so a count logged with ``reduce_fx="sum"`` is the batch's, not a microbatch's mean.
    None for what is no number (torchmetrics objects: logged by the last stage only)."""
    if not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
        return None
    fx = kwargs.get("reduce_fx", args[4] if len(args) > 4 else "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "")
    return float(_REDUCE.get(name, _REDUCE["mean"])([float(v) for v in values]))  # tensors: captured detached


class StageLogs:
    """A pipeline's logged values and step results, from the last stage to every stage (``ranks``: see
    .transfers.Ranks; ``batched``: NCCL), with what it remembers across steps."""

    _CAPACITY = 62  # logged numbers per step that fit the fixed broadcast (more: sent pickled)

    def __init__(self, module, ranks, batched: bool):
        self.module, self.ranks, self.batched = module, ranks, batched
        self.batch_values = BatchValues()  # logged torchmetrics' step values over the microbatches
        self.log_names = None  # the last stage's logged names as of the previous step (see _share_numbers)
        self.mirrored = {}  # (path, list state) -> items already sent (see _mirror_metrics)

    @property
    def is_last(self) -> bool:
        return self.ranks.mesh.pp_rank == self.ranks.pp - 1

    def publish(self, logs_per_mb: list, result, numbers=None, train: bool = True, device=None):
        """Reduce the last stage's logs over microbatches, share them and the result (training: the mean loss,
        through a tensor on ``device``) with every stage, and log them there. See docs/design/pipeline-run.md."""
        self.batch_values.finish()
        own = {}
        for sink in logs_per_mb:
            for name, value, args, kwargs in sink:
                own.setdefault(name, [[], args, kwargs])[0].append(value)
        shared = [(n, _reduce(v, a, k), a, k) for n, (v, a, k) in own.items()]
        mirrored = {}
        if self.ranks.pp > 1:
            last = self.ranks.rank_of(self.ranks.pp - 1)
            if train:
                shared, result = self._share_numbers(shared, result, last, numbers, device)
            else:
                box = [shared, result]
                dist.broadcast_object_list(box, src=last, group=self.ranks.mesh.pp_group)
                shared, result = box
            if any(mean is None for _, mean, _, _ in shared):
                mirrored = self._mirror_metrics(own, shared, last)
        for name, mean, args, kwargs in shared:
            if mean is not None:
                self.module.log(name, mean, *args, **kwargs)
            elif name in mirrored:
                self.module.log(name, mirrored[name], *args, **kwargs)
            elif name in own:
                self.module.log(name, own[name][0][-1], *args, **kwargs)
        return result

    def _mirror_metrics(self, own, shared, last) -> dict:
        """Copy the state of torchmetrics objects the last stage logged into the same attributes on every other
        stage (one pickled broadcast). Returns {name: this stage's metric} (not on the last). See
        docs/design/pipeline-run.md."""
        is_last = self.is_last
        box = [None]
        sent = self.mirrored
        if is_last:
            paths = {id(m): p for p, m in self.module.named_modules()}
            logged = {n: own[n][0][-1] for n, mean, _, _ in shared if mean is None and n in own}
            box[0] = {n: (paths[id(m)], metric_state_of(m, paths[id(m)], sent))
                      for n, m in logged.items() if id(m) in paths}
        dist.broadcast_object_list(box, src=last, group=self.ranks.mesh.pp_group)
        if is_last:
            return {}
        out = {}
        for name, (path, state) in box[0].items():
            out[name] = self.module.get_submodule(path)
            load_metric_state(out[name], state)
        return out

    def post_numbers(self, device):
        """Gloo: a non-last stage posts the receive of the step's numbers (see _share_numbers) at step
        start, so they are there when its step ends, instead of a collective's round trips then."""
        if self.batched or self.ranks.pp == 1 or self.is_last:
            return None
        buf = torch.zeros(2 + self._CAPACITY, dtype=torch.float64, device=device)
        last = self.ranks.rank_of(self.ranks.pp - 1)
        return buf, dist.irecv(buf, last, tag=tag(3, 0, 0, self.ranks.n_vstages))

    def _send_numbers(self, buf) -> None:
        """The last stage's side of post_numbers (gloo); NCCL: one broadcast, receives never posted ahead."""
        if self.batched:
            dist.broadcast(buf, src=self.ranks.rank_of(self.ranks.pp - 1), group=self.ranks.mesh.pp_group)
            return
        works = [dist.isend(buf, self.ranks.rank_of(s), tag=tag(3, 0, 0, self.ranks.n_vstages))
                 for s in range(self.ranks.pp - 1)]
        for w in works:
            w.wait()

    def _share_numbers(self, shared, loss, last, posted=None, device=None):
        """The last stage's mean loss and logged numbers to every stage, as one float64 tensor; the
        names (pickled) only when they change or more numbers than fit were logged."""
        is_last = self.is_last
        buf = torch.zeros(2 + self._CAPACITY, dtype=torch.float64, device=device)
        if is_last:
            names = [(n, a, k, mean is not None) for n, mean, a, k in shared]
            values = [loss] + [mean for _, mean, _, _ in shared if mean is not None]
            try:
                changed = bool(names != self.log_names)
            except (RuntimeError, ValueError):  # kwargs holding tensors: compare by sending them
                changed = True
            buf[0] = float(changed) + 2.0 * (len(values) > self._CAPACITY + 1)
            buf[1:1 + min(len(values), self._CAPACITY + 1)] = torch.tensor(values[:self._CAPACITY + 1],
                                                                           dtype=torch.float64)
        if is_last:
            self._send_numbers(buf)
        elif posted is not None:
            buf, work = posted
            work.wait()
        else:
            dist.broadcast(buf, src=last, group=self.ranks.mesh.pp_group)
        flags = int(buf[0])
        if flags:
            box = [names if is_last else None, values if is_last and flags & 2 else None]
            dist.broadcast_object_list(box, src=last, group=self.ranks.mesh.pp_group)
            self.log_names = box[0]
        if not flags & 2:
            values = buf[1:].tolist()
        else:
            values = box[1]
        it = iter(values[1:])
        shared = [(n, next(it) if has_mean else None, a, k) for n, a, k, has_mean in self.log_names]
        return shared, values[0]


def metric_state_of(metric, path: str, sent: dict) -> dict:
    """What a torchmetrics Metric's values follow from, on the CPU (to travel pickled). A list state
    (one entry per update: AUROC's predictions) travels as the entries added since the last time,
    ``(start, new entries)``, so a step costs its own entries, not the epoch's so far."""
    cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    states = {}
    for k, v in metric.metric_state.items():
        if isinstance(v, list):
            held, start = sent.get((path, k), (None, 0))
            start = start if held is v else 0  # reset since (a new list, a new epoch): all of it again
            states[k], sent[(path, k)] = (start, [cpu(x) for x in v[start:]]), (v, len(v))
        else:
            states[k] = cpu(v)
    return {"states": states, "count": metric._update_count, "step_value": tree_map(cpu, metric._forward_cache)}


def load_metric_state(metric, state: dict) -> None:
    """The last stage's state into this stage's metric; a list state's first ``start`` entries are the
    ones received before (what this stage's own updates added after them is dropped)."""
    device = metric.device
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    for k, v in state["states"].items():
        if isinstance(v, tuple):
            start, new = v
            v = list(getattr(metric, k))[:start] + [move(x) for x in new]
        setattr(metric, k, v if isinstance(v, list) else move(v))
    metric._update_count, metric._forward_cache, metric._computed = state["count"], tree_map(
        move, state["step_value"]), None
