"""zero=3 (parameters, gradients and optimizer state sharded over dp by FSDP2) against the single-process
ground truth, with the parity harness of helpers.py."""

import contextlib
from unittest import mock

import pytest

from helpers import check, train_launch

CLIP_ACCUMULATE = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)

TEN = dict(max_steps=10)

# name: (model kind, model kwargs, strategy kwargs, trainer kwargs); the gpt model steps AdamW on an LR schedule
WORLD2 = {
    "dp2_zero3": ("gpt", {}, dict(zero=3), {}),
    "dp2_zero3_clip_accumulate_bf16": ("gpt", {}, dict(zero=3), dict(precision="bf16-mixed", **CLIP_ACCUMULATE, **TEN)),
    "dp2_zero3_recompute": ("gpt", {}, dict(zero=3, activation_checkpointing=True), TEN),
    "dp2_zero3_hf_llama": ("hf_llama", {}, dict(zero=3), TEN),
}
WORLD4 = {
    "tp2_sp_dp2_zero3_clip_accumulate": ("gpt", {}, dict(tp=2, sp=True, zero=3), CLIP_ACCUMULATE),
    "tp2_dp2_zero3_hf_llama": ("hf_llama", {}, dict(tp=2, zero=3), TEN),
    # 66 rows over 4 ranks: FSDP2 pads the last shard
    "dp4_zero3_uneven": ("gpt", dict(vocab_size=66), dict(zero=3), dict(gradient_clip_val=0.05, **TEN)),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, WORLD2, tmp_path_factory, "z3a")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return train_launch(4, WORLD4, tmp_path_factory, "z3b")


@pytest.mark.parametrize("name", list(WORLD2))
def test_zero3_world2(world2, name):
    check(world2, name, WORLD2, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_zero3_world4(world4, name):
    check(world4, name, WORLD4, 4)


def _bytes(rank, world):
    """Parameter and optimizer-state elements this rank holds after training, zero=0 then zero=3; and
    those of a gradient at the optimizer step."""
    import lightning as L
    import torch
    import torch.distributed as torch_dist

    from lightning_tp import MegaStrategy
    from lightning_tp.dp.zero.local_shards import local
    from models import LossRecorder, TokenData, make_model, trainer_kwargs

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.numel = sum(local(p.grad).numel() for p in module.parameters() if p.grad is not None)

    torch_dist.init_process_group("gloo")
    out = {}
    for zero in (0, 3):
        model, grads, first = make_model("gpt"), Grads(), LossRecorder()
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(zero=zero, timeout=120), max_steps=3,
                            callbacks=[grads, first], **trainer_kwargs())
        counted = {}
        with counting(counted, "all_gather_single", 0, "output"), counting(counted, "reduce_scatter_single", 1, "input"):
            trainer.fit(model, TokenData(3 * 4 * world, 64, 4))
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        params = list(model.parameters())
        out[zero] = dict(params=sum(local(p).numel() for p in params), state=sum(local(v).numel() for v in state),
                         grads=grads.numel, rows=sum(p[0].numel() if p.dim() > 1 else 1 for p in params),
                         kinds={type(p).__name__ for p in params}, first_loss=first.losses[0],
                         collectives={k: (n / 3, b / 3) for k, (n, b) in counted.items()})  # per step
    # the sharded module fitted again by a second Trainer: its steps still go through FSDP2's hooks
    rec = LossRecorder()
    L.Trainer(devices=world, strategy=MegaStrategy(zero=3, timeout=120), max_steps=3, callbacks=[rec],
              **trainer_kwargs()).fit(model, TokenData(3 * 4 * world, 64, 4))
    out["again"] = dict(losses=rec.losses, kinds={type(p).__name__ for p in model.parameters()})
    return out


@contextlib.contextmanager
def counting(counted: dict, name: str, at: int, key: str):
    """Count calls of ``torch.distributed.<name>`` (what FSDP2 calls) and the bytes of its argument ``at``
    or ``key`` (the gathered output, the scattered input)."""
    import torch.distributed as torch_dist

    real = getattr(torch_dist, name)

    def wrapper(*args, **kwargs):
        n, b = counted.get(name, (0, 0))
        whole = kwargs[key] if key in kwargs else args[at]
        counted[name] = (n + 1, b + whole.numel() * whole.element_size())
        return real(*args, **kwargs)

    with mock.patch.object(torch_dist, name, wrapper):
        yield


def test_zero3_holds_a_dp_share_of_parameters_gradients_and_optimizer_state():
    import dist

    dist_results = dist.run(2, _bytes, timeout=300)
    for r in dist_results:
        whole, sharded = r[0], r[3]
        assert whole["kinds"] == {"Parameter"} and sharded["kinds"] == {"DTensor"}, (whole, sharded)
        assert whole["state"] == 2 * whole["params"] == 2 * whole["grads"]  # AdamW: two moments per parameter
        # each tensor split by rows over dp=2: this rank's half, up to one row per tensor where rows are odd
        for key, per_param in (("params", 1), ("grads", 1), ("state", 2)):
            assert abs(sharded[key] - whole[key] / 2) <= per_param * whole["rows"], (key, sharded, whole)
            assert sharded[key] < 0.6 * whole[key], (key, sharded, whole)
    for r in dist_results:
        assert len(r["again"]["losses"]) == 3 and r["again"]["kinds"] == {"DTensor"}, r["again"]
        assert max(r["again"]["losses"]) < r[0]["first_loss"], (r["again"], r[0]["first_loss"])
    # explain counts the same: rank 0's shards, and each step's all-gathers and reduce-scatters
    from lightning_tp import explain
    from models import make_model

    rank0 = r0 = dist_results[0][3]
    est = explain(make_model("gpt"), dp=2, zero=3, batch_shape=(4, 64), print_report=False).rank(0)
    assert est.weight_bytes == 4 * r0["params"] and est.optim_state_bytes == 4 * r0["state"], (est, rank0)
    assert est.grad_held_bytes == 4 * r0["grads"], (est, rank0)
    ops = {op: (n, b) for op, _, n, b in est.dp_ops}
    assert ops["all_gather"] == r0["collectives"]["all_gather_single"], (ops, r0["collectives"])
    assert ops["reduce_scatter"] == r0["collectives"]["reduce_scatter_single"], (ops, r0["collectives"])


def _bad(rank, world):
    import warnings

    import torch.distributed as torch_dist

    from helpers import expect_error
    from lightning_tp import MegaStrategy
    from models import make_model

    torch_dist.init_process_group("gloo")
    out = {"copied_kv": expect_error(world, make_model("hf_llama", kv_heads=1), MegaStrategy(tp=2, zero=3, timeout=60))[0]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["tp4_dp1"] = expect_error(world, make_model("gpt"), MegaStrategy(tp=4, zero=3, timeout=60))[0]
    out["warned"] = [str(w.message) for w in caught if "zero=3" in str(w.message)]
    return out


def test_zero3_refuses_copied_kv_heads_on_every_rank_and_warns_at_dp1():
    import dist

    got = dist.run(4, _bad, timeout=300)
    for r in got:
        assert r["copied_kv"] is not None and "MegaStrategy(zero=3): model.model.layers.0.self_attn.k_proj" in \
            r["copied_kv"] and "Use zero=1, or tp at most the number of key/value heads" in r["copied_kv"], r
        assert r["tp4_dp1"] is None  # trains, unsharded
    assert any("dp=1 here" in w and "nothing is sharded" in w for w in got[0]["warned"]), got[0]["warned"]
