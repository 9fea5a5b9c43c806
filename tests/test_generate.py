"""Generation with the model after fit: greedy decoding under tp=2 equals one process; under pp=2, where a step
may call the model once, generate() in predict_step is refused on every rank with what to use instead."""

import lightning as L
import torch
import torch.distributed as torch_dist

import dist
from lightning_tp import MegaStrategy
from models import HFCausalLM, TokenData, trainer_kwargs

PROMPT, NEW = 4, 5  # prompt tokens, tokens generated


class Generating(HFCausalLM):
    """A Hugging Face Llama whose predict_step decodes greedily with generate()."""

    def __init__(self):
        super().__init__("llama", layers=2)

    def predict_step(self, batch, batch_idx):
        return self.model.generate(batch[0][:, :PROMPT], max_new_tokens=NEW, do_sample=False, use_cache=True,
                                   pad_token_id=0)


def _generate(rank, world):
    torch_dist.init_process_group("gloo")
    out = {}
    torch.manual_seed(0)
    model = Generating()
    reference = Generating()
    reference.load_state_dict(model.state_dict())
    data = TokenData(4, 64, 2).train_dataloader()
    out["one"] = [reference.predict_step(b, i) for i, b in enumerate(data)]
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2), **trainer_kwargs())
    out["tp2"] = trainer.predict(model, data)
    pipelined = Generating()
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(pp=2, microbatches=2, timeout=60), max_steps=1,
                        **trainer_kwargs())
    trainer.fit(pipelined, TokenData(4, 64, 2))
    try:
        trainer.predict(pipelined, data)
        out["pp2"] = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        out["pp2"] = f"{type(e).__name__}: {e} " + " ".join(getattr(e, "__notes__", []))
    return out


def test_greedy_generation_under_tp_equals_one_process_and_pp_refuses_it_clearly():
    for got in dist.run(2, _generate, timeout=300):
        assert all(torch.equal(a, b) for a, b in zip(got["one"], got["tp2"], strict=True)), (got["one"], got["tp2"])
        assert got["one"][0].shape[1] == PROMPT + NEW
        assert got["pp2"] is not None and "calls the model's forward more than once" in got["pp2"], got["pp2"]
        assert "MegaStrategy(pp=1)" in got["pp2"]
