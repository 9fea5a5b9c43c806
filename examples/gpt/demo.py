"""`make demo`: train the example GPT with tp=2 x dp=2 (+sp) on CPU, then print a sample.

The sample comes from the *consolidated* checkpoint loaded into a plain single-device model, which
shows the round trip a user relies on: train sharded, ship an ordinary state_dict.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from examples.gpt.lit import LitGPT  # noqa: E402
from examples.gpt.train import main  # noqa: E402
from lightning_tp import consolidate  # noqa: E402

CONFIG = str(Path(__file__).parent / "config.yaml")


def demo(args=None):
    """args: LightningCLI flags over the example's config (None: the command line's, as `make demo ARGS=...`
    passes them). The config is the parser's default rather than a `--config` prepended to `args`: every
    process the strategy starts re-runs this script with sys.argv, and LightningCLI warns when it is
    given `args` as well as a command line."""
    cli = main(args, run=False, parser_kwargs={"default_config_files": [CONFIG]})
    trainer = cli.trainer
    trainer.fit(cli.model, cli.datamodule)
    # the weights to ship (consolidated below); ModelCheckpoint's checkpoint in the run's log directory
    # keeps the optimizer and loop state for resuming. Saying so also spares the "`weights_only` was not
    # set" line Lightning prints on every rank.
    path = str(Path(trainer.default_root_dir) / "final.ckpt")
    trainer.save_checkpoint(path, weights_only=True)
    if trainer.is_global_zero:
        model = LitGPT(**{k: v for k, v in cli.model.hparams.items() if not k.startswith("_")})
        model.load_state_dict(consolidate(path))
        model.eval()
        torch.manual_seed(0)
        prompt = torch.tensor([list(b"ROMEO:\n")])
        out = model.model.generate(prompt, max_new_tokens=200, temperature=0.8)
        print("\n--- sample from the consolidated single-device model ---")
        print(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
        print(f"--- final train_loss {float(trainer.callback_metrics['train_loss']):.3f} ---")


if __name__ == "__main__":
    demo()
