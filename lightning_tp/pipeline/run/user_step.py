"""The user's own step (``training_step``, ``validation_step``...) run on one microbatch as one virtual stage:
the stage's run recorded for the block wrappers (see .stage), its logs captured. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

from .logs import captured_logs, find_metrics, muted_metrics
from .stage_state import StageDone, StageRun


class UserStep:
    """Runs the user's step as one virtual stage of this rank (``stage``: the map .stage.install made)."""

    def __init__(self, module, layout, stage, batch_values):
        self.module, self.layout, self.stage, self.batch_values = module, layout, stage, batch_values
        self.metrics = None  # torchmetrics modules of the user's module (muted in all but the last chunk)

    def run(self, hook: str, micro, rest, vstage, received, logs, arrival=None, on_stop=None):
        """The user's step on one microbatch as virtual stage ``vstage``: (ran to its end, its result or what the
        stage hands on); ``arrival``, ``on_stop``: see .stage.StageRun (activation_wait, send_at_stop)."""
        run = self.stage.run = StageRun(vstage, received, activation_wait=arrival, send_at_stop=on_stop)
        mute = vstage // self.layout.pp < self.layout.v - 1
        try:
            if self.metrics is None:  # looked up once: walking the module per microbatch adds up
                self.metrics = find_metrics(self.module)
            step = getattr(self.module, hook)
            with captured_logs(self.module, logs):
                if self.metrics:
                    with muted_metrics(self.metrics, mute), self.batch_values.recording([] if mute else self.metrics):
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
            run.carried, run.tail = [], []
        run.wait_for_activation()  # a run that never reached its first block
        return result
