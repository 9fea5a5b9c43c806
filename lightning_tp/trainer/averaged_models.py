"""Lightning's weight-averaging callbacks hold a copy of the module: make it of the sharded one."""

from __future__ import annotations

import copy


def copy_averaged_models_again(trainer, module) -> None:
    """Make Lightning's weight-averaging callbacks copy the sharded module again (their ``setup`` copied it
    whole, before sharding): each rank averages its own shards. See docs/design/strategy.md."""
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
