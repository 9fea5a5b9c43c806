"""ParallelConfig: MegaStrategy's options resolved once; the strategy, parallelize and explain read it."""

import dataclasses

import pytest

from lightning_tp import MegaStrategy
from lightning_tp.config import ParallelConfig


def test_defaults_resolved_once():
    c = ParallelConfig.resolve(tp=2, pp=2)
    assert (c.microbatches, c.pipelined, c.dp, c.kernels, c.stage_layers) == (2, True, None, (), None)
    assert c.with_world(8).dp == 2 and c.with_world(8).world_size == 8
    assert ParallelConfig.resolve(tp=1, sp=True).sp is False
    assert ParallelConfig.resolve(kernels=True).kernels and ParallelConfig.resolve(stage_layers=[1, 3]).stage_layers == (1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tp = 4


def test_the_strategy_holds_the_resolved_config():
    s = MegaStrategy(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4)
    assert s.config == ParallelConfig.resolve(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4)
    assert (s.tp, s.pp, s.sp) == (2, 2, False)


@pytest.mark.parametrize("kw, message", [
    (dict(tp=0), "tp must be a positive integer"),
    (dict(p2p="fast"), "choose 'auto', 'eager' or 'batched'"),
    (dict(pp=2, schedule="nope"), "unknown schedule 'nope'"),
    (dict(quant="int3"), "unknown quantization mode"),
    (dict(quant_range="learned"), "needs quant='int8' or 'w4a8'"),
    (dict(activation_checkpointing=-1), "positive int n"),
    (dict(split_backward="sometimes"), "use 'auto', 'drain', True or False"),
    (dict(kernels=["nope"]), "unknown kernel"),
    (dict(microbatches=0), "microbatches must be a positive integer"),
    (dict(pp=2, virtual_stages=0), "virtual_stages must be a positive integer"),
    (dict(ep=0), "ep must be a positive integer"),
    (dict(zero=2), r"zero=2\): choose 0 .*, 1 .* or 3 "),
    (dict(zero=3, pp=2), r"zero=3\) with pp=2, microbatches=2: .* Use zero=1 with a pipeline"),
    (dict(zero=3, microbatches=2), r"zero=3\) with pp=1, microbatches=2"),
    (dict(zero=3, ep=2), r"zero=3\) with ep=2: expert weights differ .* Use zero=1"),
    (dict(zero=3, quant="int8"), r"zero=3\) with quant='int8'"),
    (dict(zero=True), "choose 0"),
])
def test_bad_options_are_refused_by_config_and_strategy_alike(kw, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig.resolve(**kw)
    with pytest.raises(ValueError, match=message):
        MegaStrategy(**kw)


def test_world_size_must_divide():
    with pytest.raises(ValueError, match="world size divisible by tp\\*pp=3"):
        ParallelConfig.resolve(tp=3).with_world(4)


@pytest.mark.parametrize("pp, hf, enc_dec, ckpt, expected", [
    (2, False, False, False, "drain"), (2, True, False, False, False), (2, False, True, False, False),
    (2, False, False, True, False), (1, False, False, False, False), (1, True, False, False, False)])
def test_split_backward_resolved_per_model(pp, hf, enc_dec, ckpt, expected):
    choices = ParallelConfig.resolve(pp=pp, activation_checkpointing=ckpt).for_model(hf, enc_dec)
    assert choices.split_backward == expected
    assert choices.hf_recompute == (hf and pp > 1) and bool(choices.recompute) == (ckpt or (hf and pp > 1))
