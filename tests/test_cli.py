"""The strategy from LightningCLI YAML and from its registered name, without starting processes."""

import os

import lightning as L
import pytest
import yaml

import lightning_tp
from examples.gpt.train import main


def test_yaml_config_builds_mega_strategy(tmp_path):
    config = {
        "trainer": {"accelerator": "cpu", "devices": 4, "max_steps": 1, "logger": False,
                    "strategy": {"class_path": "lightning_tp.MegaStrategy", "init_args": {"tp": 2, "sp": True}}},
        "model": {"n_layer": 1, "n_embd": 32},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = main(["--config", str(path)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lightning_tp.MegaStrategy)
    assert (strategy.tp, strategy.sp, strategy.num_processes) == (2, True, 4)
    assert cli.model.hparams.n_layer == 1


def _strategy_from_yaml(tmp_path, init_args):
    config = {"trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 1, "logger": False,
                          "strategy": {"class_path": "lightning_tp.MegaStrategy", "init_args": init_args}},
              "model": {"n_layer": 2, "n_embd": 32}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return main(["--config", str(path)], run=False).trainer.strategy


@pytest.mark.parametrize("value", [True, 2, False])
def test_yaml_activation_checkpointing_keeps_its_type(tmp_path, value):
    """true (every block), an int (the first n of each stage), false: jsonargparse must not turn 2 into True."""
    got = _strategy_from_yaml(tmp_path, {"pp": 2, "activation_checkpointing": value}).config.activation_checkpointing
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("value", ["model.transformer.h", ["model.encoder.layers", "model.decoder.layers"]])
def test_yaml_pipeline_blocks_takes_a_path_or_an_encoder_decoders_two(tmp_path, value):
    assert _strategy_from_yaml(tmp_path, {"pp": 2, "pipeline_blocks": value}).config.pipeline_blocks == value


@pytest.mark.parametrize("value", ["drain", "auto", True, False])
def test_yaml_split_backward_keeps_its_type(tmp_path, value):
    """"drain" / "auto" stay strings and true / false booleans (jsonargparse must not turn "auto" into True)."""
    got = _strategy_from_yaml(tmp_path, {"pp": 2, "split_backward": value}).config.split_backward
    assert got == value and type(got) is type(value)


def test_example_config_parses():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cli = main(["--config", os.path.join(root, "examples", "gpt", "config.yaml")], run=False)
    assert isinstance(cli.trainer.strategy, lightning_tp.MegaStrategy) and cli.trainer.strategy.tp == 2


def test_registered_name():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mega", logger=False)
    assert isinstance(trainer.strategy, lightning_tp.MegaStrategy)


def test_yaml_activation_checkpointing_takes_selective(tmp_path):
    strategy = _strategy_from_yaml(tmp_path, {"tp": 2, "activation_checkpointing": "selective"})
    assert strategy.config.selective and strategy.config.activation_checkpointing is False
