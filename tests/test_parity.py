"""Every layout against the single-process ground truth: fp32, 20 AdamW steps, per-step loss and
consolidated final weights within 1e-5 (the harness and its tolerances: helpers.py)."""

import pytest

from helpers import BATCH, FP16, check, train_launch

CLIP = dict(gradient_clip_val=0.05)  # small enough to clip every step: the global norm must be right
ACCUMULATE = dict(accumulate_grad_batches=2)

# name: (model kind, model kwargs, strategy kwargs, trainer kwargs)
WORLD2 = {
    "tp2": ("gpt", {}, dict(tp=2), {}),
    "tp2_sp": ("gpt", {}, dict(tp=2, sp=True), {}),
    "dp2": ("gpt", {}, dict(tp=1), {}),
    "tp2_encoder": ("encoder", {}, dict(tp=2), {}),
    "tp2_sp_encoder": ("encoder", {}, dict(tp=2, sp=True), {}),
    "tp2_sp_tied_padded_vocab": ("gpt", dict(vocab_size=63, tie_weights=True), dict(tp=2, sp=True), {}),
    # the logits the model returns are whole, though its own loss reads vocabulary shards
    "tp2_sp_own_loss_padded_vocab": ("gpt_own_loss", dict(vocab_size=63), dict(tp=2, sp=True), {}),
    # manual optimization accumulating over 2 batches: each manual_backward syncs, sums over tp once
    "tp2_sp_manual_accumulate": ("gpt", dict(manual_accumulate=2), dict(tp=2, sp=True),
                                 dict(max_steps=6, samples=12 * BATCH)),
    # weight averaging (its final weights are the average): copies of the sharded module
    "tp2_sp_ema": ("gpt", dict(averaging="ema"), dict(tp=2, sp=True), dict(max_steps=10)),
    "tp2_swa": ("gpt", dict(averaging="swa"), dict(tp=2), dict(max_steps=10, max_epochs=2, samples=5 * BATCH)),
    "pp2_ema": ("gpt", dict(averaging="ema"), dict(pp=2, microbatches=2), dict(max_steps=10)),  # stages copied
    "tp2_sp_clip": ("gpt", {}, dict(tp=2, sp=True), CLIP),
    # random crops in a loader worker seeded with the global rank: every rank trains on rank 0's batch
    "tp2_random_crops": ("gpt", {}, dict(tp=2), dict(crops=True, max_steps=10)),
    "pp2_random_crops": ("gpt", {}, dict(pp=2, microbatches=2), dict(crops=True, max_steps=10)),
    # code between the blocks runs once, on the sending stage (h = h + gelu(block(h)))
    "pp2_loop_residual": ("loop", {}, dict(pp=2, microbatches=2), dict(max_steps=10)),
    # ... and hands the next block a view of its result (h = h.view(...)): the received activation goes into it
    "pp2_loop_residual_view": ("loop", dict(view_after=True), dict(pp=2, microbatches=2), dict(max_steps=10)),
    # the blocks in an nn.Sequential called as a whole (h = self.blocks(h)), two chunks a rank; in an
    # nn.ModuleDict walked in order (torchtitan's layers), recomputed
    "pp2_loop_dict_recompute": ("loop", dict(container="dict"),
                                dict(pp=2, microbatches=2, activation_checkpointing=True), dict(max_steps=10)),
    "pp2_loop_sequential_interleaved": ("loop", dict(container="sequential"),
                                        dict(pp=2, microbatches=2, schedule="interleaved_1f1b"), dict(max_steps=10)),
    # each block an nn.ModuleList of pieces the loop calls one by one (for mix, mlp in self.blocks), with
    # the residuals around them in the loop; two chunks a rank, each piece recomputed
    "pp2_loop_pieces": ("loop", dict(container="pieces"), dict(pp=2, microbatches=2), dict(max_steps=10)),
    "pp2_loop_pieces_interleaved_recompute": ("loop", dict(container="pieces"),
                                              dict(pp=2, microbatches=2, schedule="interleaved_1f1b",
                                                   activation_checkpointing=True), dict(max_steps=10)),
    # a norm per block in a list of its own, walked with the blocks (zip(self.blocks, self.norms)): block
    # i's norm goes to block i's stage; two chunks a rank, and zero bubble's split backward
    "pp2_loop_zip_interleaved": ("loop", dict(container="zip"),
                                 dict(pp=2, microbatches=2, schedule="interleaved_1f1b"), dict(max_steps=10)),
    "pp2_loop_zip_zb_h1": ("loop", dict(container="zip"), dict(pp=2, microbatches=2, schedule="zb_h1"),
                           dict(max_steps=10)),
    # each block under the user's own non-reentrant checkpoint: recomputed outside the stage's run
    "pp2_loop_own_checkpoint": ("loop", dict(own_checkpoint=True), dict(pp=2, microbatches=2), dict(max_steps=10)),
    "pp2_zb_loop_own_checkpoint": ("loop", dict(own_checkpoint=True), dict(pp=2, microbatches=2, schedule="zb_h1"),
                                   dict(max_steps=10)),
    # the first stage holds no trainable parameter: no backward there
    "pp2_loop_frozen_first": ("loop", dict(frozen_first=True), dict(pp=2, microbatches=2), dict(max_steps=10)),
    "pp2_zb_loop_frozen_first": ("loop", dict(frozen_first=True), dict(pp=2, microbatches=2, schedule="zb_h1"),
                                 dict(max_steps=10)),
    "dp2_accumulate": ("gpt", {}, dict(tp=1), ACCUMULATE),
    "tp2_demo_transformer": ("demo_transformer", {}, dict(tp=2), {}),  # nn.Transformer encoder-decoder
    # sp: each stack split where its layers begin, gathered after its final norm (the encoder's output
    # into the cross-attention whole, the decoder's into the demo's head outside the plan)
    "tp2_sp_demo_transformer": ("demo_transformer", {}, dict(tp=2, sp=True), {}),
    # activation checkpointing without a pipeline: both of the encoder-decoder's block lists recompute
    "tp2_demo_transformer_recompute": ("demo_transformer", {}, dict(tp=2, activation_checkpointing=True), {}),
    "tp2_sp_recompute": ("gpt", {}, dict(tp=2, sp=True, activation_checkpointing=True), {}),
    "dp2_recompute": ("gpt", {}, dict(tp=1, activation_checkpointing=True), {}),  # dp buckets start in backward
    # microbatches without stages: the first block of the one stage recomputes
    "dp2_m2_recompute_first1": ("gpt", {}, dict(tp=1, microbatches=2, activation_checkpointing=1), {}),
    "tp2_sp_kernels": ("gpt", {}, dict(tp=2, sp=True, kernels=True), {}),  # torch twins of the fused modules
    "dp2_kernels": ("gpt", {}, dict(tp=1, kernels=True), {}),
    "tp2_sp_int8_qat": ("gpt", dict(quant="int8"), dict(tp=2, sp=True, quant="int8"), {"max_steps": 10}),
    "tp2_w4a8_qat": ("gpt", dict(quant="w4a8"), dict(tp=2, quant="w4a8"), {"max_steps": 10}),
    "tp2_fp16": ("gpt", {}, dict(tp=2), FP16),  # GradScaler: every rank skips or steps together
    "tp2_sp_int8_qat_delayed": ("gpt", dict(quant="int8", quant_range="delayed"),
                                dict(tp=2, sp=True, quant="int8", quant_range="delayed"), {"max_steps": 10}),
}
WORLD4 = {
    "tp2_dp2": ("gpt", {}, dict(tp=2), {}),
    "tp2_dp2_sp": ("gpt", {}, dict(tp=2, sp=True), {}),
    "tp2_dp2_sp_clip_accumulate": ("gpt", {}, dict(tp=2, sp=True), {**CLIP, **ACCUMULATE}),
    # a parameter some replicas' batches do not reach (and, some steps, none): zeros in its bucket
    "tp2_dp2_sometimes_used": ("gpt_sometimes", {}, dict(tp=2), {}),
    # experts beyond dp: 4 experts over the stage's 4 ranks (tp x dp), the norm clipped every step
    "tp2_dp2_ep4_clip": ("gpt", dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32),
                         dict(tp=2, ep=4), CLIP),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, WORLD2, tmp_path_factory, "w2")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return train_launch(4, WORLD4, tmp_path_factory, "w4")


@pytest.mark.parametrize("name", list(WORLD2))
def test_parity_world2(world2, name):
    check(world2, name, WORLD2, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_parity_world4(world4, name):
    check(world4, name, WORLD4, 4)
