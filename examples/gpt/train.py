"""LightningCLI entry for the example: python examples/gpt/train.py fit --config examples/gpt/config.yaml"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # so `examples.gpt` imports from a checkout

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_tp  # noqa: E402,F401  (registers strategy="mega")
from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402


def main(args=None, run=True, **cli_kwargs):
    return LightningCLI(LitGPT, ShakespeareData, args=args, run=run, save_config_callback=None, **cli_kwargs)


if __name__ == "__main__":
    main()
