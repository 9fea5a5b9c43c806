"""Lightning's weight-averaging callbacks hold a copy of the module: make it of the sharded one."""

from __future__ import annotations

import copy


def copy_averaged_models_again(trainer, module) -> None:
    """Lightning's weight-averaging callbacks (EMAWeightAveraging and the other WeightAveraging ones,
    StochasticWeightAveraging) copy the module in their ``setup``, which runs before the strategy
    shards it: their copies would hold whole weights against this rank's shards. They copy the
    sharded module again here, as their setup does (each rank averages its own shards)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # older Lightning
        WeightAveraging = ()
    for cb in trainer.callbacks:
        if getattr(cb, "_average_model", None) is None:
            continue
        if WeightAveraging and isinstance(cb, WeightAveraging):
            from torch.optim.swa_utils import AveragedModel

            cb._average_model = AveragedModel(model=module, device=cb._device or module.device,
                                              use_buffers=cb._use_buffers, **cb._kwargs)
        elif isinstance(cb, StochasticWeightAveraging):
            cb._average_model = copy.deepcopy(module)
