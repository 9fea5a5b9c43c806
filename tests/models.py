"""Tiny seeded models, fixed data and a single-process reference run for the parity tests."""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from examples.gpt.lit import LitGPT

SEQ = 16
MELS = 8  # Whisper's spectrogram bins (HFSeq2SeqLM)


class Tokens(Dataset):
    """Seeded arithmetic sequences (random start and stride): learnable in a few steps, so a parity
    test compares runs that actually move, not noise around the initial loss."""

    def __init__(self, n: int, vocab: int, seq: int = SEQ, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(seq + 1)) % vocab

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class CroppedTokens(Tokens):
    """Each sample a random window of a longer sequence, drawn in a loader worker: the worker's seed
    is Lightning's ``seed_everything(workers=True)`` one, which mixes in the global rank."""

    EXTRA = 4

    def __init__(self, n: int, vocab: int):
        super().__init__(n, vocab, seq=SEQ + self.EXTRA)

    def __getitem__(self, i):
        o = int(torch.randint(0, self.EXTRA + 1, ()))
        return self.data[i, o:o + SEQ], self.data[i, o + 1:o + SEQ + 1]


class TokenData(L.LightningDataModule):
    """Under a parallel strategy Lightning shuffles with DistributedSampler(seed=0) over dp ranks. The
    reference (``single=True``) uses the same sampler with one replica, so its global batch k is the
    union of the dp ranks' batches k. ``crops``: :class:`CroppedTokens` in one worker seeded as
    ``seed_everything(workers=True)`` does (with the global rank), the loader's base seed from its own
    generator (the default one's position differs once a strategy has built its layers)."""

    def __init__(self, n: int, vocab: int, batch_size: int, single: bool = False, crops: bool = False):
        super().__init__()
        self.n, self.vocab, self.batch_size, self.single, self.crops = n, vocab, batch_size, single, crops

    def train_dataloader(self):
        data = (CroppedTokens if self.crops else Tokens)(self.n, self.vocab)
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if self.single else None
        if not self.crops:
            return DataLoader(data, batch_size=self.batch_size, sampler=sampler)
        from functools import partial

        from lightning.fabric.utilities.seed import pl_worker_init_function

        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=1,
                          worker_init_fn=partial(pl_worker_init_function, rank=self.trainer.global_rank),
                          generator=torch.Generator().manual_seed(7))


# Adam's eps: key-projection biases have an exactly-zero true gradient (softmax ignores a constant
# shift of the scores), so their gradient is pure float32 rounding noise (~1e-9), which Adam with
# eps=1e-8 turns into full-size steps that differ with any change of summation order. eps=1e-4 keeps
# those parameters still while every real gradient (1e-3 and up) is stepped as usual.
ADAM_EPS = 1e-4


class ParityGPT(LitGPT):
    """The example GPT plus what a real project has: an LR schedule and a torchmetrics metric."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tokens_seen = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.tokens_seen.update(torch.tensor(float(batch[1].numel())))
        self.log("tokens", self.tokens_seen, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=ADAM_EPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class OwnLossGPT(ParityGPT):
    """Reads the logits the model returns: its own loss on them (label smoothing, which the
    vocab-parallel loss does not take), added to the model's, and an accuracy from their argmax."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, inner = self.model(x, y)
        loss = inner + 0.5 * F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)
        self.log("acc", (logits.argmax(-1) == y).float().mean())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class EncoderLM(L.LightningModule):
    """A causal LM built from torch's nn.TransformerEncoder, as a user would write it."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, ff=64, lr=3e-3):
        super().__init__()
        self.lr = lr
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(SEQ, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        t = x.shape[1]
        h = self.emb(x) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.encoder(h, mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=ADAM_EPS)


class Seq2SeqLM(L.LightningModule):
    """An encoder-decoder built from torch's parts as a user might write one: a source and a target
    embedding of its own, an encoder without a final norm, and a Linear bridge to the decoder."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, ff=64, head_first=False, tie_weights=False, unused=False):
        super().__init__()
        if head_first:  # registered before the embeddings (as litgpt does), so listed first where it is real
            self.head = nn.Linear(d, vocab)
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        if unused:  # never called: one process leaves it without a gradient, so AdamW does not touch it
            self.spare_emb = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, 0.0, batch_first=True), layers,
                                             enable_nested_tensor=False)
        self.bridge = nn.Linear(d, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, ff, 0.0, batch_first=True), layers)
        if not head_first:
            self.head = nn.Linear(d, vocab)
        if tie_weights:
            self.head.weight = self.tgt_emb.weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        memory = self.bridge(self.encoder(self.src_emb(x)))
        out = self.head(self.decoder(self.tgt_emb(x), memory, tgt_mask=mask, tgt_is_causal=True))
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=ADAM_EPS)


class HFSeq2SeqLM(L.LightningModule):
    """A Hugging Face encoder-decoder (BART, T5, mT5, Whisper, Switch Transformers) built from a config, head
    tied to the embedding as the library does; the loss is the model's own from ``labels``. Whisper's input
    is a spectrogram: here each source token's fixed random column of ``MELS`` features (SEQ frames)."""

    def __init__(self, family: str, layers: int = 2, attention: str = "sdpa", padded: bool = False,
                 hidden_loss: bool = False):
        super().__init__()
        import transformers as tf

        self.padded = padded  # every other source row's last 2 tokens masked out (attention_mask)
        self.hidden_loss = hidden_loss  # terms on what the stacks return on request (hidden states, maps)
        attention = "eager" if hidden_loss else attention  # eager: attention maps to return
        eager = dict(attn_implementation="eager") if hidden_loss else {}

        if family == "bart":
            config = tf.BartConfig(vocab_size=64, d_model=32, encoder_layers=layers, decoder_layers=layers,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                   decoder_start_token_id=2, scale_embedding=True, attn_implementation=attention)
            self.model = tf.BartForConditionalGeneration(config)
        elif family == "t5":
            config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                 **eager)  # transformers 5's T5 takes sdpa by default: no attention maps
            self.model = tf.T5ForConditionalGeneration(config)
        elif family == "mt5":  # gated MLP (wi_0, wi_1), a head of its own (not tied)
            config = tf.MT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                                  dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **eager)
            self.model = tf.MT5ForConditionalGeneration(config)
        elif family == "switch":  # T5's layout; every second block's MLP is top-1 experts with a capacity per
            # sequence (4 of a row's 16 tokens per expert: some are dropped), its router losses in the loss
            config = tf.SwitchTransformersConfig(
                vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers, num_heads=4,
                num_experts=4, expert_capacity=4, encoder_sparse_step=2, decoder_sparse_step=2, dropout_rate=0.0,
                router_jitter_noise=0.0, router_z_loss_coef=0.1, router_aux_loss_coef=0.5, decoder_start_token_id=0,
                pad_token_id=0, **eager)
            self.model = tf.SwitchTransformersForConditionalGeneration(config)
            self.router_losses = dict(output_router_logits=True)
        else:  # its decoder blocks are given encoder_hidden_states by keyword
            config = tf.WhisperConfig(vocab_size=64, num_mel_bins=MELS, d_model=32, encoder_layers=layers,
                                      decoder_layers=layers, encoder_attention_heads=4, decoder_attention_heads=4,
                                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=SEQ // 2,
                                      max_target_positions=SEQ, dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                      decoder_start_token_id=0, suppress_tokens=[], begin_suppress_tokens=[])
            self.model = tf.WhisperForConditionalGeneration(config)
            self.register_buffer("mels", torch.randn(64, MELS, generator=torch.Generator().manual_seed(0)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if hasattr(self, "mels"):
            loss = self.model(input_features=self.mels[x].transpose(1, 2), labels=y).loss
        elif self.padded:
            mask = torch.ones_like(x)
            mask[::2, -2:] = 0
            loss = self.model(input_ids=x, attention_mask=mask, labels=y).loss
        elif self.hidden_loss:  # the encoder's output, a decoder layer's first tokens, per-head map entries
            out = self.model(input_ids=x, labels=y, output_hidden_states=True, output_attentions=True)
            heads = torch.arange(1.0, 5.0)
            loss = out.loss + out.encoder_last_hidden_state[:, -1].pow(2).mean() + \
                out.encoder_hidden_states[-2][:, -2:].pow(2).mean() + out.decoder_hidden_states[1][:, :3].pow(2).mean()
            for maps in (out.encoder_attentions, out.decoder_attentions, out.cross_attentions):
                loss = loss + (maps[0][:, :, -1, 0] * heads).mean()
        else:
            loss = self.model(input_ids=x, labels=y, **getattr(self, "router_losses", {})).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=ADAM_EPS)


class HFCausalLM(L.LightningModule):
    """A minimal LightningModule around a Hugging Face causal LM built from a config (no download)."""

    def __init__(self, family: str, layers: int = 2, padded: bool = False, heads: int = 4, kv_heads: int = 2,
                 hidden_loss: bool = False, grad_ckpt: bool = False, config_kw: dict | None = None, hidden: int = 32,
                 two_groups: bool = False):
        super().__init__()
        import transformers as T

        self.padded, self.hidden_loss, self.two_groups = padded, hidden_loss, two_groups
        common = dict(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ * 2,
                      attention_dropout=0.0, tie_word_embeddings=False)
        falcon = dict(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, max_position_embeddings=SEQ * 2, attention_dropout=0.0,
                      hidden_dropout=0.0)
        configs = {
            "gpt2": lambda: T.GPT2Config(vocab_size=64, n_positions=SEQ * 2, n_embd=32, n_layer=layers, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "llama": lambda: T.LlamaConfig(**common),
            "qwen2": lambda: T.Qwen2Config(**common),
            "mistral": lambda: T.MistralConfig(**common),
            # mixtures of experts (4 experts, top-2): what MegaStrategy(ep=...) splits
            "mixtral": lambda: T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                               router_jitter_noise=0.0),
            "olmoe": lambda: T.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
            "qwen2_moe": lambda: T.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                  decoder_sparse_step=1, mlp_only_layers=[]),
            # transformers 5.x only: their experts are one module of 3-D weights; DeepSeek-V3's group-limited
            # sigmoid routing with a correction bias, a shared expert and a dense first layer; GPT-OSS's
            # attention sinks (eager attention only), expert biases and clamped SwiGLU
            "qwen3_moe": lambda: T.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                                                  norm_topk_prob=True),
            "deepseek_v3": lambda: T.DeepseekV3Config(**dict(common, num_key_value_heads=4), moe_intermediate_size=16,
                                                      n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                                      topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                                                      kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                                      v_head_dim=8, n_shared_experts=1, rope_scaling=None),
            "gpt_oss": lambda: T.GptOssConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=4),
            # Llama 4: its router's sigmoid scales each expert's input, a shared expert, experts in 3-D weights of
            # its own layout; a dense first layer (MoE every second), per-head L2 norms, chunked attention
            "llama4": lambda: T.Llama4TextConfig(**common, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                                                 num_experts_per_tok=2, interleave_moe_layer_step=2),
            # hybrids: Qwen3-Next's gated delta-net layers (their out_proj planned colwise_gather_output) beside full
            # attention; MiniMax's lightning attention beside full attention at the same path; Jamba's Mamba layers
            "qwen3_next": lambda: T.Qwen3NextConfig(**dict(common, num_hidden_layers=2), head_dim=8, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=32,
                                                    layer_types=["linear_attention", "full_attention"]),
            "minimax": lambda: T.MiniMaxConfig(**dict(common, num_hidden_layers=2), head_dim=8, num_local_experts=4,
                                               num_experts_per_tok=2, layer_types=["full_attention", "linear_attention"]),
            "jamba": lambda: T.JambaConfig(**dict(common, num_hidden_layers=2), num_experts=4, num_experts_per_tok=2,
                                           attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                                           expert_layer_offset=0, use_mamba_kernels=False),
            "qwen3": lambda: T.Qwen3Config(**common, head_dim=8),  # per-head q_norm / k_norm
            "phi3": lambda: T.Phi3Config(**common, pad_token_id=0),  # fused qkv_proj and gate_up_proj
            # its base model under `model` though its prefix says `language_model`; scaled embedding
            "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=8, sliding_window=4),
            # a hand-written plan; with a narrower embedding, project_in / project_out around the layers
            "opt": lambda: T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                                       num_attention_heads=heads, max_position_embeddings=SEQ * 2, dropout=0.0,
                                       attention_dropout=0.0),
            "opt_proj": lambda: T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                                            num_attention_heads=heads, max_position_embeddings=SEQ * 2, dropout=0.0,
                                            attention_dropout=0.0, word_embed_proj_dim=48, init_std=0.2),
            # fused [q|k|v] per head, `embed_in` / `embed_out`, parallel residual, partial rotary
            "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=layers, num_attention_heads=heads,
                                                max_position_embeddings=SEQ * 2, rotary_pct=0.5,
                                                attention_dropout=0.0, hidden_dropout=0.0),
            # no config plan; q, k, v fused in one of three layouts (see plans/falcon.py): grouped per
            # key/value head (40B's), all queries then one k and v (7B's: multi-query, tied head, parallel
            # attention), and per head (sequential attention and MLP, biases)
            "falcon": lambda: T.FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=kv_heads,
                                             tie_word_embeddings=False),
            "falcon_mq": lambda: T.FalconConfig(**falcon, multi_query=True),
            "falcon_mha": lambda: T.FalconConfig(**falcon, multi_query=False, parallel_attn=False, bias=True,
                                                 tie_word_embeddings=False),
            "falcon_alibi": lambda: T.FalconConfig(**falcon, multi_query=False, alibi=True),
        }
        config = configs[family]()
        for k, v in (config_kw or {}).items():  # e.g. output_router_logits=True (an MoE's aux loss)
            setattr(config, k, v)
        sdpa = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: eager attention only
        config._attn_implementation = "eager" if hidden_loss else (config_kw or {}).get("_attn_implementation", sdpa)
        self.model = T.AutoModelForCausalLM.from_config(config)
        if grad_ckpt:  # Hugging Face's own gradient checkpointing (reentrant, its default)
            self.model.gradient_checkpointing_enable()

    def on_after_batch_transfer(self, batch, dataloader_idx):
        """``padded="batch"`` (or ``"batch_left"``): the padding travels in the batch, as a tokenizer's collate
        would give it."""
        if self.padded not in ("batch", "batch_left"):
            return batch
        x, _ = batch
        mask = torch.ones_like(x)
        mask[::2, -3:] = 0
        if self.padded == "batch_left":
            mask = mask.flip(1)
        return {"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)}

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # padded="batch"
            loss = self.model(**batch, use_cache=False).loss
            self.log("train_loss", loss, sync_dist=True)
            return loss
        x, _ = batch
        if self.padded:  # every other row right-padded by 3 tokens: masked out, labels ignored
            mask = torch.ones_like(x)
            mask[::2, -3:] = 0
            labels = x.masked_fill(mask == 0, -100)
            loss = self.model(input_ids=x, attention_mask=mask, labels=labels, use_cache=False).loss
        elif self.hidden_loss:  # a value head on the last token, a term on the first layer's first tokens
            # and one on the last query's attention to the first key, per head
            out = self.model(input_ids=x, labels=x, use_cache=False, output_hidden_states=True,
                             output_attentions=True)
            loss = out.loss + out.hidden_states[-1][:, -1].pow(2).mean() + out.hidden_states[1][:, :3].pow(2).mean()
            loss = loss + (out.attentions[0][:, :, -1, 0] * torch.arange(1.0, 5.0)).mean()
        else:
            loss = self.model(input_ids=x, labels=x, use_cache=False).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        if not self.two_groups:
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=ADAM_EPS)
        # the LM recipe's two groups (as TwoGroupGPT): matrices (5.x's 3-D experts too) decayed, the rest not
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0, lr=9e-3)],
                                 lr=3e-3, eps=ADAM_EPS)


class ResidualGelu(nn.Module):
    """``h + gelu(inner(h))``: LoopLM's code between the blocks, inside a block of its own."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return h + F.gelu(self.inner(h))


class LoopLM(L.LightningModule):
    """Code between the blocks (a residual over the user's own variable and an activation after each
    block); or each block under the user's own checkpoint (``own_checkpoint=True``: non-reentrant,
    plainly; ``"residual"``: with that code too; ``"reentrant"``); ``frozen_first``: the embedding and
    the first two blocks frozen (a pipeline's first stage then holds no trainable parameter), and with
    ``filtered`` the optimizer given only trainable parameters; ``view_after``: each block's result
    reshaped to a view before the next block; ``container``: the blocks (residual inside) in an
    ``nn.Sequential`` called as a whole (``"sequential"``) or in an ``nn.ModuleDict`` walked in order
    (``"dict"``, as torchtitan's models hold their layers), or each block an ``nn.ModuleList`` of two
    pieces the loop calls one by one with the residuals around them (``"pieces"``: ``for mix, mlp in
    self.blocks``, as many research models write it), or a norm per block in a list of its own walked
    with them (``"zip"``: ``for block, norm in zip(self.blocks, self.norms)``); ``long_skip``: the embedding's output added
    to the last block's (it cannot work under pp: only hidden states travel between stages)."""

    def __init__(self, d: int = 32, layers: int = 4, own_checkpoint=False, frozen_first: bool = False,
                 filtered: bool = False, view_after: bool = False, container: str = "list",
                 long_skip: bool = False):
        super().__init__()
        self.filtered = filtered  # the optimizer gets only trainable parameters
        self.view_after, self.long_skip = view_after, long_skip
        self.emb, self.norm, self.head = nn.Embedding(64, d), nn.LayerNorm(d), nn.Linear(d, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(layers))
        if container == "sequential":
            self.blocks = nn.Sequential(*(ResidualGelu(block) for block in self.blocks))
        elif container == "dict":
            self.blocks = nn.ModuleDict({f"layer{i}": ResidualGelu(block) for i, block in enumerate(self.blocks)})
        elif container == "zip":  # a norm per block in a list of its own, walked with the blocks
            self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        elif container == "pieces":  # each layer a ModuleList of a mixer and an MLP, called one by one
            self.blocks = nn.ModuleList(nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)), block])
                                        for block in self.blocks)
        self.own_checkpoint = own_checkpoint
        if frozen_first:
            for m in (self.emb, self.blocks[0], self.blocks[1]):
                m.requires_grad_(False)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = x0 = self.emb(x)
        if isinstance(self.blocks, nn.Sequential):
            return self.head(self.norm(self.blocks(h)))
        if isinstance(self.blocks, nn.ModuleDict):
            for layer in self.blocks.values():
                h = layer(h)
            return self.head(self.norm(h))
        if hasattr(self, "norms"):
            for block, norm in zip(self.blocks, self.norms):
                h = h + F.gelu(block(norm(h)))
            return self.head(self.norm(h))
        if isinstance(self.blocks[0], nn.ModuleList):  # the residuals in the loop, around each piece
            for mix, mlp in self.blocks:
                h = mix(h) + h
                h = F.gelu(mlp(h)) + h
            return self.head(self.norm(h))
        for block in self.blocks:
            if self.own_checkpoint == "residual":  # refused under pp: see stage._in_users_checkpoint
                h = h + F.gelu(checkpoint(block, h, use_reentrant=False))
            elif self.own_checkpoint:
                h = checkpoint(block, h, use_reentrant=self.own_checkpoint == "reentrant")
            else:
                h = h + F.gelu(block(h))
            if self.view_after:  # a later stage's first block is then given a view
                h = h.view(h.shape)
        if self.long_skip:
            h = h + x0
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):  # every parameter, frozen ones too (they keep no gradient)
        params = [p for p in self.parameters() if p.requires_grad] if self.filtered else self.parameters()
        return torch.optim.AdamW(params, lr=3e-3, eps=ADAM_EPS)


class LitGPTLM(L.LightningModule):
    """A minimal LightningModule around litgpt's GPT (grouped queries, RoPE, LLaMA MLP, RMSNorm)."""

    def __init__(self, layers: int = 2, query_groups: int = 2, n_expert: int = 0):
        super().__init__()
        from litgpt import GPT, Config

        moe = dict(mlp_class_name="LLaMAMoE", n_expert=n_expert, n_expert_per_token=2, moe_intermediate_size=32) \
            if n_expert else dict(mlp_class_name="LLaMAMLP")
        self.model = GPT(Config(block_size=SEQ * 2, vocab_size=64, padded_vocab_size=64, n_layer=layers, n_head=4,
                                n_query_groups=query_groups, n_embd=32, intermediate_size=64, **moe,
                                norm_class_name="RMSNorm", rotary_percentage=1.0, parallel_residual=False,
                                bias=False))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=ADAM_EPS)


class DemoTransformerLM(L.LightningModule):
    """Lightning's own demo model (nn.Transformer encoder-decoder), dropout off for parity."""

    def __init__(self, nlayers: int = 2, tie_weights: bool = False):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=64, ninp=32, nhead=4, nhid=64, nlayers=nlayers, dropout=0.0)
        if tie_weights:  # as PyTorch's word_language_model offers (--tied)
            self.model.decoder.weight = self.model.embedding.weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self.model(x, y), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.nll_loss(self.model(x, y), y.reshape(-1)))

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y).view(x.shape[0], -1, self.model.vocab_size)

    def configure_optimizers(self):
        # 1e-3: at 3e-3 the 4-layer model oscillates on the 10-step data, and one process accumulating 4
        # microbatches (the same math) drifts from the whole batch by 6e-4 in 10 steps: rounding, amplified
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=ADAM_EPS)


class MyAttention(nn.Module):
    """A custom attention class no built-in plan knows: fused qkv, its own head count."""

    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MyBlock(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), MyAttention(d, n_heads)
        self.norm2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.relu(self.up(self.norm2(x))))


class CustomLM(L.LightningModule):
    def __init__(self, vocab=64, d=32, n_heads=4, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MyBlock(d, n_heads) for _ in range(layers)])
        self.out = nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        loss = F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=ADAM_EPS)


# A user plan, written as a LightningCLI YAML would give it (plain dicts and strings).
CUSTOM_PLAN = {
    "name": "custom_lm",
    "styles": {
        "emb": "vocab",
        "blocks.*.attn": "region",  # enter TP (and leave SP) at the module that reads x.shape
        "blocks.*.attn.qkv": {"style": "colwise_local", "chunks": 3},
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "blocks.*.norm*": "sp_norm",
        "out": "lm_head",
    },
    "attrs": {"blocks.*.attn": {"n_heads": "divide"}},
    "sp_start": "blocks.*",
    "blocks": "blocks",
}


GPT_SMALL = dict(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


def make_model(kind: str, reference: bool = False, **kw):
    """``quant=`` in kw: the reference (single process) gets QAT layers here; a parallel run gets them
    from MegaStrategy(quant=...). ``manual_accumulate=k``: manual optimization, stepping every k batches;
    ``averaging="ema"`` or ``"swa"``: Lightning's EMAWeightAveraging or StochasticWeightAveraging."""
    quant, quant_range = kw.pop("quant", None), kw.pop("quant_range", "ema")
    manual, averaging = kw.pop("manual_accumulate", None), kw.pop("averaging", None)
    model = _build(kind, **kw)
    if manual:
        _manually_accumulated(model, manual)
    if averaging:  # Lightning's weight-averaging callbacks copy the module before the strategy shards it
        from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

        model.configure_callbacks = lambda: [EMAWeightAveraging(decay=0.5) if averaging == "ema" else
                                             StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)]
    if quant and reference:
        from lightning_tp.quant import apply_qat

        apply_qat(model, quant, act_range=quant_range)
    return model


def _manually_accumulated(model, k: int) -> None:
    """Lightning's documented manual accumulation: ``manual_backward(loss / k)`` every batch, a step
    and zero_grad every k-th (the LR schedule, if any, is not stepped: manual optimization)."""
    step = model.training_step

    def training_step(batch, batch_idx):
        loss = step(batch, batch_idx)
        model.manual_backward(loss / k)
        if (batch_idx + 1) % k == 0:
            opt = model.optimizers()
            opt.step()
            opt.zero_grad()

    model.automatic_optimization = False
    model.training_step = training_step


class TwoGroupGPT(ParityGPT):
    """AdamW with the usual LM recipe's two param groups: matrices decayed, the rest (biases, norms) not, at
    another learning rate."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0,
                                                                           lr=self.hparams.lr * 3)],
                                lr=self.hparams.lr, eps=ADAM_EPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SometimesGPT(ParityGPT):
    """A parameter that only some samples reach: a data-parallel replica whose batch holds none of them
    has no gradient for it (every replica must still step it alike)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = nn.Linear(self.hparams.n_embd, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.model.transformer.wte(x)
        loss = self.model(x, y)[1]
        chosen = x[:, 0] < 8  # about an eighth of the rows
        if chosen.any():
            loss = loss + self.extra(h[chosen]).pow(2).sum() / x.shape[0]
        self.log("train_loss", loss, sync_dist=True)
        return loss


def _build(kind: str, **kw):
    L.seed_everything(0, verbose=False)
    if kind == "gpt":
        return ParityGPT(**{**GPT_SMALL, **kw})
    if kind == "gpt_two_groups":
        return TwoGroupGPT(**{**GPT_SMALL, **kw})
    if kind == "gpt_sometimes":
        return SometimesGPT(**{**GPT_SMALL, **kw})
    if kind == "gpt_own_loss":
        return OwnLossGPT(**{**GPT_SMALL, **kw})
    if kind == "encoder":
        return EncoderLM(**kw)
    if kind in ("hf_bart", "hf_t5", "hf_mt5", "hf_whisper", "hf_switch"):
        return HFSeq2SeqLM(kind[3:], **kw)
    if kind.startswith("hf_"):
        return HFCausalLM(kind[3:], **kw)
    if kind == "custom":
        return CustomLM(**kw)
    if kind == "litgpt":
        return LitGPTLM(**kw)
    if kind == "demo_transformer":
        return DemoTransformerLM(**kw)
    if kind == "loop":
        return LoopLM(**kw)
    if kind == "seq2seq":
        return Seq2SeqLM(**kw)
    raise ValueError(kind)


def vocab_of(model) -> int:
    if isinstance(model, LitGPT):
        return model.hparams.vocab_size
    if isinstance(model, HFCausalLM):
        return model.model.config.vocab_size
    if isinstance(model, CustomLM):
        return model.out.out_features
    if isinstance(model, LitGPTLM):
        return model.model.config.padded_vocab_size
    if isinstance(model, DemoTransformerLM):
        return model.model.vocab_size
    if isinstance(model, HFSeq2SeqLM):
        return model.model.config.vocab_size
    return model.head.out_features


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def trainer_kwargs(**kw):
    """``fp16=True``: fp16 autocast with a GradScaler, as precision="16-mixed" on a GPU (Lightning
    turns that flag into bf16 on a CPU, so the plugin is given directly)."""
    base = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    if kw.pop("fp16", False):
        from lightning.pytorch.plugins import MixedPrecision

        base["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    base.update(kw)
    return base


_REFERENCES: dict = {}
# references kept on disk between test processes and runs, under a key that covers the code and versions
# they may depend on (this file, examples/, lightning_tp/ for QAT references, torch, lightning, transformers,
# litgpt); LIGHTNING_TP_REFERENCE_CACHE="" turns it off
REFERENCE_CACHE = os.environ.get("LIGHTNING_TP_REFERENCE_CACHE",
                                 os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                              ".cache", "references"))


def reference_run(kind: str, model_kw: dict, steps: int, batch: int, samples: int | None = None,
                  crops: bool = False, **trainer_kw):
    """The ground truth: the same seeded module trained by Lightning on one process (on ``samples``
    samples, epoch after epoch, if given). Trained once per set of arguments (see REFERENCE_CACHE)."""
    key = repr((kind, sorted(model_kw.items()), steps, batch, samples, crops, sorted(trainer_kw.items())))
    if key not in _REFERENCES:
        path = _cached_at(key)
        if path is not None and os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            _REFERENCES[key] = (saved["losses"], saved["weights"], saved["metrics"])
        else:
            _REFERENCES[key] = _train_reference(kind, model_kw, steps, batch, samples, crops, **trainer_kw)
            if path is not None:
                losses, weights, metrics = _REFERENCES[key]
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(dict(losses=losses, weights=weights, metrics=metrics), f"{path}.{os.getpid()}")
                os.replace(f"{path}.{os.getpid()}", path)  # whole or absent for a process reading it
    return _REFERENCES[key]


_CODE: list = []


def _cached_at(key: str):
    if not REFERENCE_CACHE:
        return None
    import hashlib

    if not _CODE:
        _CODE.append(_code_and_versions())
    return os.path.join(REFERENCE_CACHE, hashlib.sha256((_CODE[0] + key).encode()).hexdigest()[:32] + ".pt")


def _code_and_versions() -> str:
    import hashlib
    import importlib.metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in [Path(__file__).resolve()] + sorted((root / "examples").rglob("*.py")) + \
            sorted((root / "lightning_tp").rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    for package in ("torch", "lightning", "transformers", "litgpt"):
        try:
            h.update(f"{package}={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package}=none".encode())
    return h.hexdigest()


def _train_reference(kind, model_kw, steps, batch, samples, crops, **trainer_kw):
    model = make_model(kind, reference=True, **model_kw)
    rec = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=[rec], use_distributed_sampler=False,
                        **trainer_kwargs(**trainer_kw))
    n = samples or steps * batch * trainer_kw.get("accumulate_grad_batches", 1)
    trainer.fit(model, TokenData(n, vocab_of(model), batch, single=True, crops=crops))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return rec.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def installed(kind: str) -> bool:
    """Whether model ``kind`` runs here: litgpt and transformers are optional extras, litgpt cannot share an
    environment with transformers 5.x (the suite runs in both), and the compat run keeps model families only."""
    import importlib.util

    need = "litgpt" if kind.startswith("litgpt") else "transformers" if kind.startswith("hf_") else None
    if need is None:  # this project's own models: the compat run (LTP_FAMILIES_ONLY) leaves them to the main one
        return not os.environ.get("LTP_FAMILIES_ONLY")
    return importlib.util.find_spec(need) is not None


def runnable(runs: dict, kind_at: int = 0) -> dict:
    """The entries of a test's run table whose model (the ``kind_at``-th field) is installed here."""
    return {name: run for name, run in runs.items() if installed(run[kind_at])}


def transformers_major() -> int:
    """The installed transformers' major version (0 where it is not installed)."""
    try:
        import transformers
    except ImportError:
        return 0
    return int(transformers.__version__.split(".")[0])
