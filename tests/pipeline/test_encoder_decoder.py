"""An encoder-decoder under pp, without processes: which stage holds what, the message format, and
what is refused. Training parity (every schedule, tp, dp, pp=4) is in test_pipeline's launches."""

import copy

import pytest
import torch
from torch import nn

from lightning_tp.marks import marks_of, set_marks
from lightning_tp.explain.estimate import explain
from lightning_tp.pipeline.transport.p2p import grad_split
from lightning_tp.pipeline.cut.placeholders import ShapeOnly, SkippedBlock
from lightning_tp.pipeline.cut.split import apply_split, plan_stages
from lightning_tp.pipeline.transport.messages import pack, unpack, with_grad_split
from lightning_tp.pipeline.run.stage import install
from lightning_tp.pipeline.run.stage_chained import carried_places, stop_at
from lightning_tp.pipeline.run.stage_state import StageDone, StageMap
from lightning_tp.plans import lookup
from models import make_model

ENC, DEC = "model.transformer.encoder.layers", "model.transformer.decoder.layers"


def _layout(pp, v=1, nlayers=2, **kw):
    model = make_model("demo_transformer", nlayers=nlayers)
    return model, plan_stages(model, pp, v, lookup.blocks_path(model, "auto"), **kw)


def test_the_plan_names_both_lists_as_one_chain():
    model, layout = _layout(2)
    assert layout.lists == ((ENC, 2), (DEC, 2)) and layout.decoder_start == 2
    assert [layout.locate(i) for i in range(4)] == [(ENC, 0), (ENC, 1), (DEC, 0), (DEC, 1)]
    assert layout.blocks(model)[3] is model.model.transformer.decoder.layers[1]


@pytest.mark.parametrize("pp, v, nlayers, layers, runs", [
    # cut at the decoder's start: the decoder's stage (1) holds the embedding's copy
    (2, 1, 2, [2, 2], {"before": {0, 1}, "between": {0}, "decoder_in": {1}, "after": {1}}),
    # cut inside the decoder: stage 0 runs the encoder's norm and the decoder's first block itself
    (2, 1, 3, [4, 2], {"before": {0}, "between": {0}, "decoder_in": {0}, "after": {1}}),
    # one block a stage, interleaved: the decoder starts at virtual stage 2, on pp rank 0
    (2, 2, 2, [1, 1, 1, 1], {"before": {0, 2}, "between": {1}, "decoder_in": {2}, "after": {3}}),
])
def test_stages_that_run_the_modules_outside_the_blocks(pp, v, nlayers, layers, runs):
    _, layout = _layout(pp, v, nlayers, stage_layers=layers)
    assert layout.runs() == runs
    assert layout.replica_ranks() == tuple(sorted({k % pp for k in runs["before"]}))


def test_each_rank_keeps_its_blocks_its_embedding_copy_and_the_norms_it_runs():
    kept = {}
    for rank in (0, 1):
        model, layout = _layout(2, stage_layers=[2, 2])
        split = apply_split(model, layout, rank)
        t = model.model.transformer
        kept[rank] = dict(embedding=not isinstance(model.model.embedding, ShapeOnly),
                          encoder_norm=not isinstance(t.encoder.norm, ShapeOnly),
                          decoder_norm=not isinstance(t.decoder.norm, ShapeOnly),
                          head=not isinstance(model.model.decoder, ShapeOnly),
                          encoder=[not isinstance(b, SkippedBlock) for b in t.encoder.layers],
                          decoder=[not isinstance(b, SkippedBlock) for b in t.decoder.layers],
                          tied=sorted(marks_of(p).pp_tied for p in split.tied))
    assert kept[0] == dict(embedding=True, encoder_norm=True, decoder_norm=False, head=False,
                           encoder=[True, True], decoder=[False, False], tied=[True])
    assert kept[1] == dict(embedding=True, encoder_norm=False, decoder_norm=True, head=True,
                           encoder=[False, False], decoder=[True, True], tied=[True])


@pytest.mark.parametrize("kind, silenced, kept", [
    ("hf_whisper", ["model.model.encoder.conv1", "model.model.encoder.conv2", "model.model.encoder.embed_positions"],
     ["model.model.decoder.embed_tokens"]),
    # BART's encoder positions are its own; its token embedding is shared with the decoder (one module, three paths)
    ("hf_bart", ["model.model.encoder.embed_positions", "model.model.encoder.layernorm_embedding"],
     ["model.model.shared"]),
])
def test_the_decoders_first_stage_does_not_run_what_only_the_encoders_input_uses(kind, silenced, kept):
    model = make_model(kind)
    layout = plan_stages(model, 2, 1, lookup.blocks_path(model, "auto"), [2, 2])
    split = apply_split(model, layout, 1)  # holds the decoder's first block and a copy of the first stage's
    assert all(split.silence[name][1] == {0} for name in silenced), split.silence.keys()
    assert not any(name in split.silence for name in kept)


def test_interleaved_chunks_silence_what_they_do_not_run():
    # 3+3 blocks as 1, 1, 1, 3 over pp=2, v=2: the decoder starts at virtual stage 3 (rank 1), the
    # encoder ends in stage 2 (rank 0)
    silenced = {}
    for rank in (0, 1):
        model, layout = _layout(2, 2, nlayers=3, stage_layers=[1, 1, 1, 3])
        split = apply_split(model, layout, rank)
        silenced[rank] = {name: runs for name, (_, runs) in split.silence.items()}
        assert len(split.tied) == 1  # the embedding, copied to both ranks
    assert silenced[0] == {"model.embedding": {0, 3}, "model.transformer.encoder.norm": {2}}
    assert silenced[1] == {"model.embedding": {0, 3}}
    model, layout = _layout(2, 2)  # one block a stage: both of rank 0's chunks (0, 2) use the embedding
    split = apply_split(model, layout, 0)
    assert (split.tied, split.silence) == ([], {}) and sorted(split.twins) == [0, 2]


@pytest.mark.parametrize("pp, v, holders", [(2, 1, (0, 1)), (2, 2, (0, 1)), (4, 1, (0, 2, 3))])
def test_a_tied_head_makes_the_last_stage_hold_a_silent_copy(pp, v, holders):
    model = make_model("demo_transformer", tie_weights=True)
    layout = plan_stages(model, pp, v, lookup.blocks_path(model, "auto"))
    assert layout.tied_head and layout.replica_ranks() == holders
    split = apply_split(model, layout, pp - 1)
    weight = model.model.decoder.weight
    assert model.model.embedding.weight is weight and split.tied == [weight] and marks_of(weight).pp_tied
    runs_there = pp - 1 in {k % pp for k in layout.runs()["before"]}  # the decoder starts on the last rank
    assert ("model.embedding" in split.silence) == (not runs_there)


def test_a_message_packs_several_tensors_and_unpacks_to_the_receivers_shapes():
    hidden, memory = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    message = pack([hidden, memory])
    assert message.shape == (2 * 3 * 4 + 2 * 5 * 4,)
    got = unpack(message, [torch.zeros(2, 3, 4), torch.zeros(2, 5, 4)])
    assert torch.equal(got[0], hidden) and torch.equal(got[1], memory)
    assert pack([hidden]) is hidden and unpack(hidden, [hidden])[0].shape == hidden.shape
    with pytest.raises(ValueError, match="same batch shapes"):
        unpack(message, [torch.zeros(2, 3, 4), torch.zeros(2, 6, 4)])
    with pytest.raises(ValueError, match="share a dtype"):
        pack([hidden, memory.double()])


def test_gradients_reach_both_senders_through_one_message():
    hidden, memory = torch.randn(2, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    leaf = pack([hidden * 2, memory * 3]).detach().requires_grad_()  # what the next stage receives
    h, m = unpack(leaf, [torch.zeros(2, 3), torch.zeros(4)])
    (h.sum() + (m * m).sum()).backward()
    pack([hidden * 2, memory * 3]).backward(leaf.grad)
    assert torch.equal(hidden.grad, torch.full((2, 3), 2.0))
    torch.testing.assert_close(memory.grad, 2 * (memory.detach() * 3) * 3)


def test_only_the_parts_that_need_a_gradient_get_one_back():
    """T5's mask beside its hidden states and position bias: it travels, its gradient does not (the
    receiver computes none, the sender gets those of the other two, as the whole message's backward
    gives them)."""
    w = torch.randn(4, requires_grad=True)
    mask = torch.randn(2, 1, 4)

    def parts():
        return [torch.ones(2, 3, 4) * w, mask, w.expand(2, 4, 4) * 2]

    def loss(h, m, b):
        return (h * h).sum() + ((b + m) ** 2).sum()

    whole = torch.cat([p.reshape(-1) for p in parts()])  # every part's gradient comes back: the reference
    leaf = whole.detach().requires_grad_()
    loss(*unpack(leaf, [torch.zeros(2, 3, 4), torch.zeros(2, 1, 4), torch.zeros(2, 4, 4)])).backward()
    whole.backward(leaf.grad)
    expected, w.grad = w.grad, None

    message = pack(parts())
    assert message._lightning_tp_grad_split == (0b101, 2 * 3 * 4 + 2 * 4 * 4)
    received = with_grad_split(message.detach().clone(), message._lightning_tp_grad_split)
    h, m, b = unpack(received, [torch.zeros(2, 3, 4), torch.zeros(2, 1, 4), torch.zeros(2, 4, 4)])
    assert torch.equal(m, mask) and not m.requires_grad and torch.equal(h, torch.ones(2, 3, 4) * w)
    loss(h, m, b).backward()
    assert received.grad.shape == (2 * 3 * 4 + 2 * 4 * 4,)  # what travels back
    message[:message._lightning_tp_grad_split[1]].backward(received.grad)  # the sender's B (see _backward)
    torch.testing.assert_close(w.grad, expected)
    with pytest.raises(ValueError, match="same batch shapes"):
        unpack(received, [torch.zeros(2, 3, 4), torch.zeros(2, 1, 4), torch.zeros(2, 5, 4)])


def test_a_stage_ends_at_the_next_stages_first_block_with_what_it_is_given():
    state = StageMap([(0, 0), (1, 1)], 1)
    block = nn.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True)
    stop_at(block, 0, state, False)
    hidden, memory = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 5, 8, requires_grad=True)
    mask = torch.triu(torch.full((3, 3), -1e9), 1)
    for args, kwargs in (((hidden, memory, mask), {}),  # floating-point positional tensors, a mask too
                         ((hidden, memory), dict(tgt_mask=mask, tgt_is_causal=False)),  # not a keyword mask
                         ((hidden,), dict(memory=memory, tgt_mask=mask))):  # an encoder's output by keyword
        with pytest.raises(StageDone) as done:
            block(*args, **kwargs)
        sent = [hidden, memory] + [mask] * (len(args) == 3)
        assert torch.equal(done.value.output, torch.cat([t.reshape(-1) for t in sent]))
    # by keyword, an encoder's output of another length and width (its own d_model), batch first or second
    for h, mem in ((torch.randn(2, 3, 8), torch.randn(2, 7, 6)), (torch.randn(3, 2, 8), torch.randn(7, 2, 6))):
        assert carried_places((h,), dict(memory=mem, tgt_mask=torch.zeros(3, 3)), False) == [0, "memory"]
        assert carried_places((h,), dict(memory=mem), True) == ["memory"]  # at the decoder's start
    # a 3-d mask by keyword ((batch x heads, T, T): its second dimension is the hidden states') stays local
    h = torch.randn(2, 5, 8)
    assert carried_places((h,), dict(memory=torch.randn(2, 7, 8), tgt_mask=torch.zeros(4, 5, 5)), False) == [0, "memory"]
    state.run.vstage = 1  # the stage that holds it: the block runs
    assert block(hidden, memory).shape == hidden.shape


class _OneSequence(nn.Module):
    """One sequence fed to both sides (a copy task): the same tensor is the encoder's and the decoder's
    input, and with no encoder norm the decoder's memory is that tensor too until the encoder runs."""

    def __init__(self, bridge=False, keyword=False, per_block=False):
        super().__init__()
        self.keyword = keyword  # the decoder's blocks given the encoder's output by keyword, with a mask
        self.per_block = per_block  # each decoder block given its own tensor made from the encoder's output
        self.emb = nn.Embedding(16, 8)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.bridge = nn.Linear(8, 8) if bridge else nn.Identity()  # registered between the lists
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True), 2)
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        e = self.emb(x)
        memory = self.bridge(self.encoder(e))
        if not self.keyword:
            return self.head(self.decoder(e, memory))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for i, layer in enumerate(self.decoder.layers):
            e = layer(e, memory=memory * (i + 1) if self.per_block else memory, tgt_mask=mask)
        return self.head(e)


def _staged(base, stage_layers, x):
    """pp=2 in one process, forward only: stage 0's message feeds stage 1, which returns the output."""
    message = None
    for rank in (0, 1):
        model = copy.deepcopy(base)
        layout = plan_stages(model, 2, 1, ["encoder.layers", "decoder.layers"], stage_layers)
        split = apply_split(model, layout, rank)
        state = install(layout.blocks(model), layout, rank,
                        [(model.get_submodule(n), twin, runs) for n, (twin, runs) in split.silence.items()])
        state.run.vstage, state.run.activation = rank, message
        try:
            out = model(x)
        except StageDone as done:
            message = done.output.detach()
    return out


@pytest.mark.parametrize("bridge, keyword", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("stage_layers", [[1, 3], [2, 2], [3, 1]])
def test_a_tensor_passed_twice_is_received_only_where_it_travels(bridge, keyword, stage_layers):
    torch.manual_seed(0)
    model, x = _OneSequence(bridge, keyword), torch.randint(0, 16, (2, 5))
    torch.testing.assert_close(_staged(model, stage_layers, x), model(x), atol=1e-6, rtol=0)


def test_a_later_block_given_what_its_stage_neither_received_nor_computed_is_refused():
    torch.manual_seed(0)
    model, x = _OneSequence(True, keyword=True, per_block=True), torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match=r"decoder.layers.1 is given 'memory' \(shape \(2, 5, 8\)\), which is neither"):
        _staged(model, [2, 2], x)  # block 1 would attend to placeholder zeros times 2
    torch.testing.assert_close(_staged(model, [3, 1], x), model(x), atol=1e-6, rtol=0)  # one decoder block a stage
    with torch.no_grad():  # cannot be told apart without gradients: validation is not checked
        _staged(model, [2, 2], x)


def test_a_bf16_model_staged_matches_it_unstaged():
    import transformers as tf

    from lightning_tp.pipeline.cut.placeholders import meta_twins

    config = tf.BartConfig(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                           dropout=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    base = tf.BartForConditionalGeneration(config).eval()
    ids, dec = torch.randint(3, 50, (2, 7)), torch.randint(3, 50, (2, 5))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, -2:] = 0
    run = lambda m: m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits.float()  # noqa: E731
    reference = run(copy.deepcopy(base).to(torch.bfloat16))
    for cut in (1, 2, 3):  # inside the encoder, at the decoder's start, inside the decoder
        message = None
        for rank in (0, 1):
            model = copy.deepcopy(base)
            layout = plan_stages(model, 2, 1, ["model.encoder.layers", "model.decoder.layers"], [cut, 4 - cut])
            split = apply_split(model, layout, rank)
            model.to(torch.bfloat16)  # as MegaStrategy.setup converts the module, then the twins
            for twin in meta_twins(model, split):
                twin.to(torch.bfloat16)
            state = install(layout.blocks(model), layout, rank, [(model.get_submodule(n), t, r) for n, (t, r)
                                                                 in split.silence.items()], split.twins)
            state.run.vstage, state.run.activation = rank, message
            try:
                out = run(model)
            except StageDone as done:  # received as the executor takes it: padding masks need no gradient
                message = with_grad_split(done.output.detach(), grad_split(done.output))
        torch.testing.assert_close(out, reference, atol=0, rtol=0)


def test_modules_between_the_lists_run_where_the_encoder_ends():
    model = _OneSequence(bridge=True)  # a Linear there is no head: it runs before the decoder
    layout = plan_stages(model, 2, 1, ["encoder.layers", "decoder.layers"], [2, 2])
    assert layout.runs()["between"] == {0}
    apply_split(model, layout, 1)
    assert isinstance(model.bridge, ShapeOnly) and not isinstance(model.head, ShapeOnly)


class _TwoEncoders(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                                         enable_nested_tensor=False) for _ in range(2))


class _HeadBetween(nn.Module):  # the head registered between the lists would run where the encoder ends
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(8, 16)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, batch_first=True), 2)


class _TwoStacks(nn.Module):  # two lists where the second continues the first: not an encoder-decoder
    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.up = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))


@pytest.mark.parametrize("model, blocks, words", [
    (_TwoStacks(), ["down", "up"], ["take the encoder's output", "take one tensor", "Name one block list"]),
    (_TwoStacks(), ["down", "up", "down"], ["encoder-decoder's two"]),
    (_OneSequence(), ["decoder.layers", "encoder.layers"], ["the encoder's registered first"]),
    (_OneSequence(), ["encoder.layers", "encoder.layers"], ["must be apart"]),
    # an encoder layer requires one tensor: two encoders are not an encoder-decoder
    (_TwoEncoders(), ["first.layers", "second.layers"], ["take one tensor"]),
    (_HeadBetween(), ["encoder.layers", "decoder.layers"], ["['head']", "register it after the decoder"]),
])
def test_what_an_encoder_decoder_pipeline_refuses(model, blocks, words):
    with pytest.raises(ValueError) as err:
        plan_stages(model, 2, 1, blocks)
    for w in words:
        assert w in str(err.value)


def test_sequence_parallel_on_a_config_with_layerdrop_is_refused_before_any_collective():
    """explain runs the strategy's checks without processes; LayerDrop without sp is fine."""
    bart = make_model("hf_bart").model
    bart.config.encoder_layerdrop = 0.05  # M2M100's default: it would skip the block where SP begins
    with pytest.raises(ValueError, match=r"LayerDrop: \{'encoder_layerdrop': 0.05\}.*config.encoder_layerdrop = 0"):
        explain(bart, tp=2, sp=True, batch_shape=(4, 16), print_report=False)
    explain(bart, tp=2, batch_shape=(4, 16), print_report=False)


class _PrenetGPT2(nn.Module):  # a decoder-only model with a second list: not an encoder-decoder
    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        self.prenet = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.gpt = GPT2Model(GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=16, n_positions=16))


class _SharedParent(nn.Module):  # both lists under one parent: where things run follows registration
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.net = nn.Module()
        self.net.enc = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2))
        self.net.enc_norm = nn.LayerNorm(8)
        self.net.dec = nn.ModuleList(nn.TransformerDecoderLayer(8, 2, 16, batch_first=True) for _ in range(2))
        self.net.dec_norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)


def test_a_block_takes_the_encoders_output_by_position_or_by_name():
    from lightning_tp.pipeline.cut.encoder_decoder import takes_encoder_output

    class Keyword(nn.Module):
        def forward(self, x, *, encoder_hidden_states=None, **kwargs):
            return x

    class OneTensor(nn.Module):
        def forward(self, x, mask=None, **encoder_kwargs):
            return x

    assert takes_encoder_output(nn.TransformerDecoderLayer(8, 2, 16, batch_first=True))
    assert takes_encoder_output(Keyword()) and not takes_encoder_output(OneTensor())
    assert not takes_encoder_output(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))


def test_found_on_its_own_only_where_the_model_says_it_is_an_encoder_decoder():
    from lightning_tp.pipeline.cut.encoder_decoder import find_encoder_decoder

    assert find_encoder_decoder(make_model("demo_transformer")) == (ENC, DEC)  # nn.TransformerDecoderLayer
    assert find_encoder_decoder(make_model("hf_t5").model) == ("encoder.block", "decoder.block")  # its config
    # Whisper: its encoder's input is convolutions, its decoder blocks get encoder_hidden_states by keyword
    assert find_encoder_decoder(make_model("hf_whisper").model) == ("model.encoder.layers", "model.decoder.layers")
    assert find_encoder_decoder(_PrenetGPT2()) is None  # GPT2Block has an encoder_hidden_states parameter
    model = _PrenetGPT2()
    assert plan_stages(model, 2, 1, "gpt.h").lists == ()  # a list named alone stays alone
    model = _SharedParent()
    layout = plan_stages(model, 2, 1)
    assert layout.lists == (("net.enc", 2), ("net.dec", 2))
    assert layout.runs()["after"] == {1}
    from lightning_tp.pipeline.cut.outer_modules import outer_groups

    groups = {k: [n for n, _ in v] for k, v in outer_groups(model, ["net.enc", "net.dec"]).items()}
    assert groups == {"before": ["emb"], "between": ["net.enc_norm"], "decoder_in": [], "after": ["net.dec_norm", "head"]}


def test_tensor_parallel_shards_keep_the_tied_marks():
    from lightning_tp.layers.linear import shard_param
    from lightning_tp.layers.shard import ShardSpec

    p = nn.Parameter(torch.randn(4, 2))
    set_marks(p, pp_tied=True, pp_tied_index=3, pp_copy=True)

    class Ctx:
        rank, world = 0, 2

    new = shard_param(p, ShardSpec(dim=0, world=2, full=4), Ctx(), {})
    assert (marks_of(new).pp_tied, marks_of(new).pp_tied_index, marks_of(new).pp_copy) == (True, 3, True) and new.shape == (2, 2)


def test_explain_models_both_lists():
    report = explain(make_model("demo_transformer"), tp=2, pp=2, microbatches=2, batch_shape=(4, 8),
                     print_report=False)
    assert report.config["blocks"] == f"{ENC} + {DEC}" and report.stages == [(0, 0, 0, 1), (1, 1, 2, 3)]
    # an encoder block: self-attention and the MLP (2 in, 2 out); a decoder block adds cross-attention,
    # whose query and memory enter the TP region apart
    assert sorted(report.layer_ops) == [("all_reduce", 32, "bwd")] * 2 + [("all_reduce", 32, "fwd")] * 2
    assert sorted(report.decoder_ops) == [("all_reduce", 32, "bwd")] * 4 + [("all_reduce", 32, "fwd")] * 3
    assert report.outer == {"first": ["model.embedding"], "between": ["model.transformer.encoder.norm"],
                            "last": ["model.transformer.decoder.norm", "model.decoder"]}
    assert "copy of the first stage's" in str(report)
