"""``python -m lightning_tp explain --config config.yaml``: the explain report for a LightningCLI config
(docs/design/explain.md); ``plan --config config.yaml --gpus N``: the ranked layouts (docs/planner.md);
``export CKPT --to hf|plain OUT``: a checkpoint's weights (docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

import yaml


def _load(spec: str):
    target, _, func = spec.partition(":")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("_lightning_tp_cli_script", os.path.abspath(target))
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, func or "main")


def build_cli(config: str, cli: str | None = None, extra=()):
    args = ["--config", config, *extra]
    if cli is None:
        with open(config) as f:
            model = (yaml.safe_load(f) or {}).get("model") or {}
        if isinstance(model, dict) and "class_path" in model:
            from lightning.pytorch.cli import LightningCLI

            cli = lambda args, run: LightningCLI(args=args, run=run, save_config_callback=None)  # noqa: E731
        else:
            script = os.path.join(os.path.dirname(os.path.abspath(config)), "train.py")
            if not os.path.exists(script):
                raise SystemExit(f"{config}: its model has no class_path and there is no train.py beside it; pass "
                                 f"--cli path/to/train.py:main (a function (args, run=False) -> LightningCLI).")
            cli = script
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it also sees this command's own flags
    try:
        return (_load(cli) if isinstance(cli, str) else cli)(args, run=False)
    finally:
        sys.argv = argv


def _config(trainer):
    """The trainer's resolved layout: MegaStrategy's config with the world size, else plain data parallel."""
    from .config import ParallelConfig
    from .strategy import MegaStrategy

    strategy, world = trainer.strategy, trainer.num_nodes * trainer.num_devices
    config = strategy.config if isinstance(strategy, MegaStrategy) else ParallelConfig.resolve()
    return config.with_world(world)


def _batch_shape(cli, flag: str | None) -> tuple:
    if flag:
        b, t = flag.split(",")
        return int(b), int(t)
    dm, hp = cli.datamodule, getattr(cli.model, "hparams", {})
    b = getattr(dm, "batch_size", None)
    t = getattr(dm, "block_size", None) or hp.get("block_size")
    if not b or not t:
        raise SystemExit("could not read the batch shape from the datamodule (batch_size, block_size); pass "
                         "--batch-shape B,T (per-process batch, sequence length).")
    return int(b), int(t)


def _bytes(precision: str) -> tuple:
    """(activation, gradient) element sizes for a Lightning precision string."""
    precision = str(precision)
    act = 8 if precision.startswith("64") else 2 if precision.startswith(("16", "bf16")) else 4
    return act, act if precision.endswith("-true") or precision.startswith("64") else 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_tp")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "explain", help="parameters, stages, communication and activation memory per rank",
        description="Report what each rank of a MegaStrategy layout holds and sends, from a LightningCLI config, "
                    "without starting any process. Flags not listed here go to the LightningCLI "
                    "(e.g. --trainer.strategy.init_args.tp 4).")
    p.add_argument("--config", required=True,
                   help="a LightningCLI YAML with trainer.devices (and num_nodes), trainer.strategy "
                        "(class_path: lightning_tp.MegaStrategy, init_args: tp, pp, ...) and a model; the batch "
                        "shape is read from data.batch_size and data/model block_size unless --batch-shape is given")
    p.add_argument("--batch-shape", help="B,T: per-process batch and sequence length (default: from the datamodule)")
    p.add_argument("--cli", help="path/to/train.py[:main] or package.module[:main]: a function (args, run=False) "
                                 "returning the LightningCLI (default: a plain LightningCLI if the config's model "
                                 "has a class_path, else the train.py beside the config)")
    e = sub.add_parser(
        "export", help="a checkpoint's weights as safetensors (plain) or a Hugging Face directory (hf)",
        description="Write a lightning_tp checkpoint directory's weights out tensor by tensor (one full tensor in "
                    "memory at a time), whatever layout wrote it.")
    e.add_argument("ckpt", help="a checkpoint directory written under MegaStrategy")
    e.add_argument("--to", choices=("plain", "hf"), default="plain",
                   help="plain: one .safetensors file under the LightningModule's names; hf: a directory "
                        "from_pretrained loads (model.safetensors, config.json)")
    e.add_argument("out", help="the .safetensors file (plain) or directory (hf) to write")
    e.add_argument("--config", help="hf: the model's config.json, or a directory holding one")
    e.add_argument("--prefix", help="hf: the LightningModule attribute holding the model, e.g. 'model.' "
                                    "(default: the one first name all weights share)")
    q = sub.add_parser(
        "plan", help="the layouts for the config's model on a cluster, fastest first",
        description="Estimate memory and step time of every layout MegaStrategy can run for the config's model "
                    "(built on the meta device: nothing is allocated) on a cluster, and rank them.")
    q.add_argument("--config", required=True, help="a LightningCLI YAML with the model (as for explain)")
    q.add_argument("--cli", help="as for explain")
    q.add_argument("--gpus", type=int, required=True)
    q.add_argument("--gpus-per-node", type=int, default=8)
    q.add_argument("--gpu-memory-gib", type=float, default=80.0)
    q.add_argument("--peak-tflops", type=float, default=989.0)
    q.add_argument("--intra-node-gbps", type=float, default=3600.0)
    q.add_argument("--inter-node-gbps", type=float, default=400.0)
    q.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    q.add_argument("--seq-len", type=int, default=None, help="default: the config's block_size")
    args, extra = parser.parse_known_args(argv)
    if args.command == "plan":
        return _plan(args, extra)
    if args.command == "export":
        from .checkpoints.export import export

        print(export(args.ckpt, args.out, to=args.to, config=args.config, prefix=args.prefix))
        return 0
    cli = build_cli(args.config, args.cli, extra)
    from .explain.estimate import explain

    act, grad = _bytes(cli.trainer.precision)
    explain(cli.model, batch_shape=_batch_shape(cli, args.batch_shape), dtype_bytes=act, grad_bytes=grad,
            accumulate_grad_batches=cli.trainer.accumulate_grad_batches, config=_config(cli.trainer))
    return 0


def _plan(args, extra) -> int:
    import torch

    from .layout_search import plan

    with torch.device("meta"):
        cli = build_cli(args.config, args.cli, extra)
    seq = args.seq_len or _batch_shape(cli, None)[1]
    print(plan(cli.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib,
               peak_tflops=args.peak_tflops, intra_node_gbps=args.intra_node_gbps,
               inter_node_gbps=args.inter_node_gbps, global_batch=args.global_batch, seq_len=seq))
    return 0


if __name__ == "__main__":
    sys.exit(main())
