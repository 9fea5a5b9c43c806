"""Real model families, built tiny from their configs (no downloads), against one process: tp=2,
tp=2+sp, pp=2 and tp=2 x pp=2, 10 AdamW steps, per-step loss and consolidated weights within 1e-5.
Hugging Face GPT-2, Llama (grouped-query attention: 4 heads, 2 kv heads), Qwen2, Mistral, Qwen3
(per-head q/k norms), and
litgpt's GPT (grouped queries, fused [q|k|v])."""

import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install lightning-tp[hf]) is not installed")
pytest.importorskip("litgpt", reason="the hf extra (pip install lightning-tp[hf]) is not installed")

import dist  # noqa: E402
from lightning_tp.plans import apply as planner  # noqa: E402
from models import make_model  # noqa: E402
from test_parity import _check, _train_all  # noqa: E402

FAMILIES = ["hf_gpt2", "hf_llama", "hf_qwen2", "hf_mistral", "hf_qwen3", "litgpt"]
PP = dict(pp=2, microbatches=2)
TEN = dict(max_steps=10)

WORLD2 = {}
for fam in FAMILIES:
    WORLD2[f"{fam}_tp2"] = (fam, {}, dict(tp=2), TEN)
    WORLD2[f"{fam}_tp2_sp"] = (fam, {}, dict(tp=2, sp=True), TEN)
    WORLD2[f"{fam}_pp2"] = (fam, {}, PP, TEN)
# attention masks, padding (ignored labels) and explicit position ids, GPT-2's tied embeddings
WORLD2["hf_llama_tp2_sp_padded"] = ("hf_llama", dict(padded=True), dict(tp=2, sp=True), TEN)
WORLD2["hf_gpt2_pp2_padded"] = ("hf_gpt2", dict(padded=True), PP, TEN)
WORLD4 = {f"{fam}_tp2_pp2": (fam, {}, dict(tp=2, **PP), TEN) for fam in FAMILIES}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return dist.run(2, _train_all, WORLD2, str(tmp_path_factory.mktemp("hf2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, world2):
    return dist.run(4, _train_all, WORLD4, str(tmp_path_factory.mktemp("hf4")))


@pytest.mark.parametrize("name", list(WORLD2))
def test_hf_parity_world2(world2, name):
    _check(world2, name, WORLD2, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_hf_parity_world4(world4, name):
    _check(world4, name, WORLD4, 4)


def test_llama_plan_comes_from_the_config():
    model = make_model("hf_llama")
    (match,) = planner.resolve(model, 2, False)
    styles = {path: style for path, style, _ in match.entries}
    assert match.plan.name == "hf_LlamaForCausalLM"
    for path in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"model.model.layers.0.self_attn.{path}"] == "colwise_local"
    assert styles["model.model.layers.0.self_attn"] == "region"
    assert styles["model.model.layers.1.mlp.down_proj"] == "rowwise"


def test_gqa_with_more_ranks_than_kv_heads_is_refused():
    with pytest.raises(ValueError, match="k_proj: out_features = 16 holds 2 heads"):
        planner.resolve(make_model("hf_llama"), 4, False)
