"""Real model families, built tiny from their configs (no downloads), against one process: tp=2,
tp=2+sp, pp=2 and tp=2 x pp=2, 10 AdamW steps, per-step loss and consolidated weights within 1e-5.
Hugging Face GPT-2, Llama (grouped-query attention: 4 heads, 2 kv heads), Qwen2, Mistral, Qwen3
(per-head q/k norms), and litgpt's GPT (grouped queries, fused [q|k|v]). With more tp ranks than
key/value heads (1 kv head at tp=2, 2 at tp=4) each kv head is copied to several ranks. The
encoder-decoders BART, T5 and Whisper at tp=2 and tp=2 x pp=2 (their plan: plans/hf_seq2seq.py).
Falcon's three fused q/k/v layouts at tp=2 with sp (plans/falcon.py)."""

import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install lightning-tp[hf]) is not installed")

import torch  # noqa: E402

from helpers import BATCH, check, train_launch  # noqa: E402
from lightning_tp.marks import marks_of  # noqa: E402
from lightning_tp.explain.estimate import explain  # noqa: E402
from lightning_tp.layers import ShardSpec, shard, unshard  # noqa: E402
from lightning_tp.plans import Plan  # noqa: E402
from lightning_tp.plans import checks, hooks  # noqa: E402
from lightning_tp.plans.sizes import check_sizes  # noqa: E402
from lightning_tp.plans import lookup  # noqa: E402
from lightning_tp.plans import swap  # noqa: E402
from models import make_model, runnable, transformers_major  # noqa: E402

FAMILIES = ["hf_gpt2", "hf_llama", "hf_qwen2", "hf_mistral", "hf_qwen3", "litgpt"]
PP = dict(pp=2, microbatches=2)
TEN, TWENTY = dict(max_steps=10), dict(max_steps=20)

WORLD2 = {}
for fam in FAMILIES:
    WORLD2[f"{fam}_tp2"] = (fam, {}, dict(tp=2), TEN)
    WORLD2[f"{fam}_tp2_sp"] = (fam, {}, dict(tp=2, sp=True), TEN)
    WORLD2[f"{fam}_pp2"] = (fam, {}, PP, TEN)
# attention masks, padding (ignored labels) and explicit position ids, GPT-2's tied embeddings
WORLD2["hf_llama_tp2_sp_padded"] = ("hf_llama", dict(padded=True), dict(tp=2, sp=True), TEN)
# a loss on the hidden states the model returns (output_hidden_states=True): whole, though sp shards them
# and on the attention maps (output_attentions=True): whole, though each rank computes its heads
WORLD2.update({f"hf_{fam}_tp2_sp_hidden_loss": (f"hf_{fam}", dict(hidden_loss=True), dict(tp=2, sp=True), TEN)
               for fam in ("llama", "gpt2")})
WORLD2["hf_gpt2_pp2_padded"] = ("hf_gpt2", dict(padded=True), PP, TEN)
# replicated kv heads: the mask path (repeat_kv reads num_key_value_groups), q/k/v biases (Qwen2),
# litgpt's fused [q|k|v], and the global norm of gradient clipping (a copy counted once)
WORLD2["hf_llama_kv1_tp2_sp_padded"] = ("hf_llama", dict(kv_heads=1, padded=True), dict(tp=2, sp=True), TEN)
WORLD2["hf_qwen2_kv1_tp2_clip"] = ("hf_qwen2", dict(kv_heads=1), dict(tp=2), dict(TEN, gradient_clip_val=0.05))
WORLD2["litgpt_kv1_tp2"] = ("litgpt", dict(query_groups=1), dict(tp=2), TEN)
# manual optimization accumulating over 2 batches: the copies' sum over tp counts each backward once
WORLD2["hf_llama_kv1_tp2_manual_accumulate"] = ("hf_llama", dict(kv_heads=1, manual_accumulate=2), dict(tp=2),
                                                dict(max_steps=5, samples=10 * BATCH))
# activation checkpointing on each family's blocks: keyword calls (Hugging Face), positional (litgpt)
WORLD2["hf_llama_pp2_recompute"] = ("hf_llama", {}, dict(PP, activation_checkpointing=True), TEN)
# Hugging Face's own gradient checkpointing (reentrant) under pp: taken over by the stages' recompute
WORLD2["hf_gpt2_pp2_hf_checkpointing"] = ("hf_gpt2", dict(grad_ckpt=True), PP, TEN)
WORLD2["hf_gpt2_tp2_sp_recompute"] = ("hf_gpt2", {}, dict(tp=2, sp=True, activation_checkpointing=True), TEN)
WORLD2["litgpt_pp2_recompute"] = ("litgpt", {}, dict(PP, activation_checkpointing=1), TEN)
# split inside the encoder: BART's padding mask (given to every block positionally) and T5's mask
# travel with the hidden states, and only the parts that need a gradient get one back (1F1B; ZB-H1's
# split backward)
WORLD2["hf_bart_pp2_padded_split_encoder"] = ("hf_bart", dict(padded=True), dict(PP, stage_layers=[1, 3]), TEN)
WORLD2["hf_t5_pp2_zb_split_encoder"] = ("hf_t5", {}, dict(PP, schedule="zb_h1", stage_layers=[1, 3]), TEN)
# ZB-H1 recomputing once for both halves, on a stage of T5's decoder blocks: their several inputs and
# tuple outputs (the position bias the first block makes from its weights goes on to the second); the
# first block's hidden states, the decoder's embedding made on this stage, are a weight-only branch,
# whose gradient goes on in W
WORLD2["hf_t5_pp2_zb_keep_recomputed_decoder_stage"] = ("hf_t5", {}, dict(
    PP, schedule="zb_h1", stage_layers=[2, 2], activation_checkpointing=True, zb_keep_recomputed=True), TEN)
WORLD2["hf_t5_pp2_batched_p2p_split_decoder"] = ("hf_t5", {}, dict(PP, stage_layers=[3, 1], p2p="batched"), TEN)
# interleaved: a rank's blocks of its other chunk pass through (in the tuple GPT-2's blocks return)
WORLD2["hf_gpt2_pp2_interleaved"] = ("hf_gpt2", dict(layers=4), dict(PP, schedule="interleaved_1f1b",
                                                                       virtual_stages=2), TEN)
# encoder-decoders: BART's three embedding modules and head tied to one weight (its embeddings scaled),
# T5's one embedding module under three paths and per-head position bias, Whisper's keyword memory
SEQ2SEQ = {"hf_bart": TEN, "hf_t5": TEN, "hf_whisper": TWENTY}  # Whisper needs 20 steps to learn measurably
WORLD2.update({f"{fam}_tp2": (fam, {}, dict(tp=2), steps) for fam, steps in SEQ2SEQ.items()})
WORLD2["hf_mt5_tp2"] = ("hf_mt5", {}, dict(tp=2), TEN)  # T5's layout with a gated MLP and an untied head
# sequence parallel: each stack's sequence split where its blocks begin, the encoder's output gathered
# where the encoder ends (T5 reads its length before the decoder's blocks); BART padded, T5 unpadded
# (its default cross-attention mask), Whisper's spectrogram front-end before the encoder's blocks
WORLD2.update({f"{fam}_tp2_sp": (fam, kw, dict(tp=2, sp=True), steps) for fam, kw, steps in
               (("hf_bart", dict(padded=True), TEN), ("hf_t5", {}, TEN), ("hf_mt5", {}, TEN),
                ("hf_whisper", {}, TWENTY))})
# what the stacks return on request (hidden states, attention and cross-attention maps) is whole
WORLD2.update({f"hf_{fam}_tp2_sp_hidden_loss": (f"hf_{fam}", dict(hidden_loss=True), dict(tp=2, sp=True), TEN)
               for fam in ("bart", "t5")})
WORLD2["hf_t5_tp2_hidden_loss"] = ("hf_t5", dict(hidden_loss=True), dict(tp=2), TEN)  # the maps without sp
# config plans whose base model, embedding or head sit under other names (Gemma 3, GPT-NeoX)
WORLD2.update({f"hf_{fam}_tp2_sp": (f"hf_{fam}", {}, dict(tp=2, sp=True), TEN) for fam in ("gemma3", "gpt_neox")})
WORLD2["hf_opt_tp2_sp"] = ("hf_opt", {}, dict(tp=2, sp=True), TEN)  # its MLP on tokens flattened to 2-d
# OPT-350m's layout registers its final norm and projections before its layers: each goes where the
# decoder calls it
WORLD2["hf_opt_proj_tp2_sp"] = ("hf_opt_proj", {}, dict(tp=2, sp=True), TEN)
WORLD2["hf_opt_proj_pp2"] = ("hf_opt_proj", {}, PP, TEN)
# Falcon's three fused q/k/v layouts (grouped, multi-query with copied k/v, per head)
WORLD2.update({f"hf_{fam}_tp2_sp": (f"hf_{fam}", {}, dict(tp=2, sp=True), TEN)
               for fam in ("falcon", "falcon_mq", "falcon_mha")})
WORLD4 = {f"{fam}_tp2_pp2": (fam, {}, dict(tp=2, **PP), TEN) for fam in FAMILIES}
WORLD4.update({f"{fam}_tp2_pp2": (fam, {}, dict(tp=2, **PP), steps) for fam, steps in SEQ2SEQ.items()})
# T5 split inside its stacks: the position bias each stage hands on is computed per tp rank's heads
# (inside the encoder; inside the decoder with the encoder-decoder bias too)
WORLD4.update({f"hf_t5_tp2_pp2_split_{at}": ("hf_t5", {}, dict(tp=2, **PP, stage_layers=layers), TEN)
               for at, layers in (("encoder", [1, 3]), ("decoder", [3, 1]))})
# interleaved: a rank's blocks of its other chunk pass through with this rank's heads' bias too
WORLD4["hf_t5_tp2_pp2_interleaved"] = ("hf_t5", {}, dict(tp=2, **PP, schedule="interleaved_1f1b", virtual_stages=2),
                                       TEN)
# sp x pp: inside a stack the hidden states travel as this rank's sequence shard, the encoder's output
# (gathered where the encoder ends) whole; split at the decoder's start, inside the encoder, inside the
# decoder, and interleaved (a rank's passthrough runs neither split nor gather stand-ins)
WORLD4["hf_bart_tp2_sp_pp2"] = ("hf_bart", dict(padded=True), dict(tp=2, sp=True, **PP), TEN)
WORLD4.update({f"hf_t5_tp2_sp_pp2_split_{at}": ("hf_t5", {}, dict(tp=2, sp=True, **PP, stage_layers=layers), TEN)
               for at, layers in (("encoder", [1, 3]), ("decoder", [3, 1]))})
WORLD4["hf_t5_tp2_sp_pp2_interleaved"] = ("hf_t5", {}, dict(tp=2, sp=True, **PP, schedule="interleaved_1f1b",
                                                            virtual_stages=2), TEN)
WORLD4["hf_llama_tp4_sp"] = ("hf_llama", {}, dict(tp=4, sp=True), TEN)  # 2 kv heads over 4 ranks
WORLD4["hf_qwen3_tp4"] = ("hf_qwen3", {}, dict(tp=4), TEN)  # and a per-head k_norm on the copies
# transformers 5.x plan styles: Phi-3's fused qkv_proj gathered whole (its attention runs on every head per
# rank) and its fused gate_up_proj split in place; OLMoE's q/k/v gathered for its norm over all heads
# (transformers 4.x names them colwise_rep / rowwise_rep, and gives OLMoE no plan: it gets 5.x's)
WORLD2["hf_phi3_tp2_sp"] = ("hf_phi3", {}, dict(tp=2, sp=True), TEN)
# the fused rotary and RMSNorm kernels (the Triton interpreter here) on Llama's own functions and norms
WORLD2["hf_llama_tp2_sp_kernels"] = ("hf_llama", {}, dict(tp=2, sp=True, kernels=["rotary", "rmsnorm"]), TEN)
WORLD2["hf_phi3_tp2"] = ("hf_phi3", {}, dict(tp=2), TEN)
WORLD2["hf_olmoe_tp2_sp"] = ("hf_olmoe", {}, dict(tp=2, sp=True), TEN)
if transformers_major() >= 5:  # hybrid layers: Qwen3-Next's gated delta-net (its out_proj split by its input) under
    # tp + sp; MiniMax's lightning attention left whole at tp (the full attention's head counts set there only)
    WORLD2["hf_qwen3_next_tp2_sp"] = ("hf_qwen3_next", {}, dict(tp=2, sp=True), TEN)
    WORLD2["hf_minimax_tp2"] = ("hf_minimax", {}, dict(tp=2), TEN)
WORLD2, WORLD4 = runnable(WORLD2), runnable(WORLD4)  # litgpt only where it is installed (transformers 4.x)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, WORLD2, tmp_path_factory, "hf2")


@pytest.fixture(scope="module")
def world4(tmp_path_factory, world2):
    return train_launch(4, WORLD4, tmp_path_factory, "hf4")


@pytest.mark.parametrize("name", list(WORLD2))
def test_hf_parity_world2(world2, name):
    check(world2, name, WORLD2, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_hf_parity_world4(world4, name):
    check(world4, name, WORLD4, 4)


def test_llama_plan_comes_from_the_config():
    model = make_model("hf_llama")
    (match,) = checks.resolve(model, 2, False)
    styles = {path: style for path, style, _ in match.entries}
    assert match.plan.name == "hf_LlamaForCausalLM"
    for path in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"model.model.layers.0.self_attn.{path}"] == "colwise_local"
    assert styles["model.model.layers.0.self_attn"] == "region"
    assert styles["model.model.layers.1.mlp.down_proj"] == "rowwise"


def test_config_plans_split_what_their_config_leaves_out_and_only_where_a_layer_has_it():
    """GPT-OSS's 5.x config plan names its embedding only: its attention is split here too, sinks by head.
    DeepSeek-V3: MLA's latents whole inside the attention's region, which its dense first MLP enters, not its MoE
    layers' block (whose replicated gradients a region would sum over tp)."""
    if transformers_major() < 5:
        return
    (oss,) = checks.resolve(make_model("hf_gpt_oss"), 2, False)
    styles = {path: (style, options) for path, style, options in oss.entries}
    assert styles["model.model.layers.0.self_attn"][1].get("head_params") == ["sinks"], styles
    assert styles["model.model.layers.1.self_attn.o_proj"][0] == "rowwise"
    (ds,) = checks.resolve(make_model("hf_deepseek_v3"), 2, False)
    styles = {path: style for path, style, _ in ds.entries}
    attn = "model.model.layers.1.self_attn"
    assert [styles.get(f"{attn}.{p}") for p in ("kv_a_proj_with_mqa", "q_a_proj", "kv_a_layernorm", "q_b_proj")] == \
        ["partial", "partial", "partial", "colwise_local"]
    assert styles["model.model.layers.0.mlp"] == "region" and "model.model.layers.1.mlp" not in styles
    assert styles["model.model.layers.1.mlp.shared_experts"] == "region"


def test_sp_refuses_a_layer_that_mixes_the_sequence_outside_the_plan():
    """Jamba's Mamba mixer has no plan entry: under sp it would see a sequence shard (tp alone keeps it whole).
    transformers 4.x gives Jamba no config plan (no tp at all: refused as any unplanned model)."""
    if transformers_major() < 5:
        return
    model = make_model("hf_jamba")
    checks.resolve(model, 2, False)
    with pytest.raises(ValueError, match=r"model.model.layers.0.mamba \(JambaMambaMixer\) mixes tokens along the "
                                         r"sequence and no plan entry splits it"):
        checks.resolve(model, 2, True)


def test_config_plans_find_base_model_embedding_and_head_by_the_model():
    gemma, neox = (checks.resolve(make_model(kind), 2, False)[0] for kind in ("hf_gemma3", "hf_gpt_neox"))
    styles = {path: style for path, style, _ in gemma.entries}
    assert styles["model.model.embed_tokens"] == "vocab" and styles["model.lm_head"] == "lm_head"
    styles = {path: (style, spec) for path, style, spec in neox.entries}
    head = "model.embed_out" if transformers_major() < 5 else "model.lm_head"  # renamed in transformers 5
    assert styles["model.gpt_neox.embed_in"][0] == "vocab" and styles[head][0] == "lm_head"
    assert styles["model.gpt_neox.layers.0.attention.query_key_value"][0] == "colwise_local"
    # its fused [q|k|v] goes out in whole heads: 2 heads cannot be split over 4 ranks
    with pytest.raises(ValueError, match="query_key_value: out_features = 96 holds 2 heads of 48"):
        checks.resolve(make_model("hf_gpt_neox", heads=2), 4, False)


def test_falcon_plans_cut_its_fused_qkv_by_its_layout():
    entries = {kind: {path: (style, spec) for path, style, spec in checks.resolve(make_model(kind), 2, False)[0].entries}
               for kind in ("hf_falcon", "hf_falcon_mq", "hf_falcon_mha")}
    qkv = "model.transformer.h.0.self_attention.query_key_value"
    assert {kind: e[qkv][0] for kind, e in entries.items()} == dict.fromkeys(entries, "colwise_local")
    assert entries["hf_falcon_mq"]["model.transformer.word_embeddings"][0] == "vocab"
    assert entries["hf_falcon_mha"]["model.transformer.h.1.post_attention_layernorm"][0] == "sp_norm"
    with pytest.raises(ValueError, match="alibi=True: its ALiBi biases are built for every head"):
        checks.resolve(make_model("hf_falcon_alibi"), 2, False)
    # grouped: 2 key/value groups (each 2 queries, k, v: 4 heads of 8) cannot go to 4 ranks
    with pytest.raises(ValueError, match="query_key_value: out_features = 64 holds 2 heads of 32"):
        checks.resolve(make_model("hf_falcon"), 4, False)
    assert lookup.blocks_path(make_model("hf_falcon_alibi"), "auto") == "model.transformer.h"  # pp still works


def test_encoder_decoder_plans_come_from_their_layers():
    for kind, plan, cross, bias in (("hf_bart", "hf_seq2seq_bart", "model.model.decoder.layers.0.encoder_attn.k_proj",
                                     None),
                                    ("hf_t5", "hf_seq2seq_t5", "model.decoder.block.0.layer.1.EncDecAttention.k",
                                     "model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
                                    ("hf_whisper", "hf_seq2seq_bart", "model.model.decoder.layers.1.encoder_attn.v_proj",
                                     None)):
        (match,) = checks.resolve(make_model(kind), 2, False)
        styles = {path: style for path, style, _ in match.entries}
        # the encoder's output enters the cross-attention's region by keyword: one entry for k and v
        region = cross.rpartition(".")[0]
        assert match.plan.name == plan and styles[cross] == "colwise_local" and styles[region] == "region"
        assert {path: opts for path, _, opts in match.entries}[region]["inputs"] == ["key_value_states"]
        assert bias is None or styles[bias] == "embedding_cols"
        assert "lm_head" in styles.values() and "vocab" in styles.values()
    with pytest.raises(ValueError, match="SelfAttention.q: out_features = 32 holds 4 heads of 8, which tp = 8"):
        checks.resolve(make_model("hf_t5"), 8, False)
    bad = dict(styles={"model.model.decoder.layers.*.encoder_attn": {"style": "region", "inputs": ["memory"]}})
    with pytest.raises(ValueError, match=r"encoder_attn is a 'region' entered by \['memory'\], which its forward"):
        checks.resolve(make_model("hf_bart"), 2, False, bad)
    with pytest.raises(ValueError, match="bias: embedding_dim"):  # one column per head: whole heads per rank
        check_sizes("bias", torch.nn.Embedding(32, 3), "embedding_cols", 2, {})


def test_every_embedding_tied_to_the_head_is_sharded_with_it():
    import transformers as tf

    # Marian with its decoder's embedding resized to 64 rows (the config still says 48), tied to the head
    model = tf.MarianMTModel(tf.MarianConfig(vocab_size=48, decoder_vocab_size=48, share_encoder_decoder_embeddings=False,
                                             d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                             max_position_embeddings=64, pad_token_id=1))
    model.resize_decoder_token_embeddings(64)
    (match,) = checks.resolve(model, 2, False)
    styles = {path: style for path, style, _ in match.entries}
    assert styles["model.decoder.embed_tokens"] == "vocab" and styles["lm_head"] == "lm_head"
    # a head held under a second path too keeps its style under the path resolve() visits (the first)
    bart = make_model("hf_bart")
    bart.model.extra = bart.model.lm_head
    (match,) = checks.resolve(bart, 2, False)
    assert ("model.lm_head", "lm_head") in {(path, style) for path, style, _ in match.entries}
    # a plan that shards a head but leaves its tied embedding whole is refused before any collective
    with pytest.raises(ValueError, match=r"model.model.shared shares a parameter with model.lm_head, which the plan "
                                         r"shards \('lm_head'\), but has no style"):
        checks.resolve(make_model("hf_bart"), 2, False, dict(styles={"model.lm_head": "lm_head"}))


def test_layouts_seen_only_in_part_are_not_taken():
    import transformers as tf

    from lightning_tp.plans.hf_seq2seq import HFSeq2SeqPlan

    fsmt = tf.FSMTForConditionalGeneration(tf.FSMTConfig(
        langs=["en", "de"], src_vocab_size=64, tgt_vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64))
    assert not HFSeq2SeqPlan().matches(fsmt)  # an attention taking (query, key): refused with a message instead
    with pytest.raises(ValueError, match="no parallelization plan matches"):
        checks.resolve(fsmt, 2, False)
    # Switch Transformers: T5's layout, whose MLPs in every second block are experts: the dense ones are split
    # over tp, the experts' own layers are not (expert parallelism places them)
    switch = make_model("hf_switch").model
    (match,) = checks.resolve(switch, 2, False)
    styled = {path for path, _, _ in match.entries}
    assert {"encoder.block.0.layer.1.mlp.wi", "decoder.block.0.layer.2.mlp.wo"} <= styled, styled
    assert not any(".experts." in path or ".router." in path for path in styled), styled


def test_an_embedding_with_its_own_forward_keeps_it_or_is_refused():
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    from lightning_tp.layers import TPContext, VocabParallelEmbedding

    ids = torch.tensor([[1, 5, 9]])
    scaled = BartScaledWordEmbedding(10, 4, padding_idx=1, embed_scale=3.0)
    tp = VocabParallelEmbedding.from_embedding(scaled, TPContext(), "shared", {})
    torch.testing.assert_close(tp(ids), scaled(ids))

    class Shifted(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1

    with pytest.raises(ValueError, match="emb: Shifted has its own forward"):
        VocabParallelEmbedding.from_embedding(Shifted(10, 4), TPContext(), "emb", {})
    # Gemma's scale is a buffer, rounded to the weight's dtype: it must follow a later bf16 conversion
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    gemma = Gemma3TextScaledWordEmbedding(10, 4, padding_idx=0, embed_scale=55.4256)
    tp = VocabParallelEmbedding.from_embedding(gemma, TPContext(), "embed_tokens", {})
    gemma.to(torch.bfloat16), tp.to(torch.bfloat16)
    assert torch.equal(tp(ids), gemma(ids)) and tp(ids).dtype == torch.bfloat16


def test_a_region_enters_each_of_its_inputs_once():
    entered = []

    class CrossAttention(torch.nn.Module):
        def forward(self, hidden_states, key_value_states=None, mask=None):
            return hidden_states

    def enter(t):
        entered.append(t)
        return t

    h, kv = torch.randn(2, 3), torch.randn(2, 5)
    hook = hooks.region_hook(enter, CrossAttention(), ["key_value_states"])
    for args, kwargs in (((h,), dict(key_value_states=kv)), ((h, kv), {}),
                         ((), dict(key_value_states=kv, hidden_states=h, mask=torch.ones(1)))):
        entered.clear()
        hook(None, args, kwargs)
        assert [id(t) for t in entered] == [id(h), id(kv)], (args, kwargs)
    entered.clear()
    hooks.region_hook(enter, CrossAttention(), ["hidden_states"])(None, (h,), {})  # the first one, named
    assert [id(t) for t in entered] == [id(h)]
    for style in ({"style": "region", "inputs": "key_value_states"}, {"style": "colwise", "inputs": ["kv"]}):
        with pytest.raises(ValueError, match="option 'inputs' of 'attn' must be a list of argument names"):
            Plan(name="p", styles={"attn": style})


def test_kv_heads_that_tp_can_neither_split_nor_copy_are_refused():
    with pytest.raises(ValueError, match="k_proj: out_features = 18 holds 3 key/value heads of 6; tp = 2 neither"):
        checks.resolve(make_model("hf_llama", heads=6, kv_heads=3, hidden=36), 2, False)
    with pytest.raises(ValueError, match="q_proj: out_features = 32 holds 4 heads of 8, which tp = 8 cannot"):
        checks.resolve(make_model("hf_llama"), 8, False)  # query heads are never copied


def test_replicated_kv_heads_shard_and_unshard():
    """[q | k | v] with 4 q rows and 2 kv heads of 1 row over tp=4: rank r holds kv head r // 2."""
    full = torch.arange(16.0).reshape(8, 2)
    spec = ShardSpec(dim=0, world=4, full=8, sections=(4, 2, 2), replicas=(1, 2, 2))
    parts = [shard(full, spec, r) for r in range(4)]
    assert [p[:, 0].tolist() for p in parts] == [[0, 8, 12], [2, 8, 12], [4, 10, 14], [6, 10, 14]]
    assert torch.equal(unshard(parts, spec), full)
    plain = ShardSpec(dim=1, world=4, full=2, replicas=(4,))  # one head, copied to all 4 ranks
    assert all(torch.equal(shard(full[:, :2], plain, r), full[:, :2]) for r in range(4))
    assert torch.equal(unshard([full[:, :2]] * 4, plain), full[:, :2])


def test_replicated_kv_heads_plan_and_explain():
    model = make_model("hf_llama", kv_heads=1)
    swap.apply(model, checks.resolve(model, 2, False), None, 2, 1, False)
    attn = model.model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (8, 32) and attn.num_key_value_groups == 2
    assert marks_of(attn.k_proj.weight).tp_spec.replicas == (2,)
    report = explain(make_model("hf_llama"), tp=4, batch_shape=(4, 16), print_report=False)
    # per rank: embedding 512, per layer q/k/v/o 4 x 256 (k, v: one whole 8-row head each), MLP 3 x 512,
    # norms 64; final norm 32, head 512
    assert [r.params for r in report.ranks] == [512 + 2 * (4 * 256 + 3 * 512 + 64) + 32 + 512] * 4


def _switch_fit(rank, world):
    """Switch Transformers (an encoder-decoder with top-1 expert MLPs and router losses) on ``world`` processes:
    pp=2 with 2 microbatches, or one process; its per-step losses."""
    import lightning as L
    import transformers as tf

    from lightning_tp import MegaStrategy
    from models import TokenData, trainer_kwargs

    class Switch(L.LightningModule):
        def __init__(self):
            super().__init__()
            L.seed_everything(0, verbose=False)
            self.model = tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
                vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                num_experts=2, encoder_sparse_step=2, decoder_sparse_step=2, dropout_rate=0.0, router_jitter_noise=0.0,
                decoder_start_token_id=0, pad_token_id=0))
            assert [b.is_sparse for b in self.model.encoder.block] == [False, True]  # experts in the second blocks

        def training_step(self, batch, batch_idx):
            x, y = batch  # with its router z-loss and load-balancing loss (the last stage takes the encoder's logits)
            loss = self.model(input_ids=x, labels=y, output_router_logits=True).loss
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    layout = dict(pp=2, microbatches=2) if world == 2 else {}
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(timeout=60, **layout), max_steps=10, callbacks=[Record()],
                        **trainer_kwargs())
    trainer.fit(Switch(), TokenData(40, 64, 4))
    return losses


def test_switch_transformers_encoder_decoder_moe_under_pp2_matches_one_process():
    """Switch Transformers under pp=2 (it once crashed on the decoder's stage; a stage stands in for the other's
    expert blocks from their output shapes): 10 steps' losses equal one process's (1e-5) on both transformers
    majors (this file runs in both environments)."""
    import dist

    (one,) = dist.run(1, _switch_fit, timeout=300)
    for losses in dist.run(2, _switch_fit, timeout=300):
        assert len(losses) == 10 and max(abs(a - b) for a, b in zip(losses, one)) < 1e-5, (losses, one)
