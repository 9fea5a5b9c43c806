"""gpu_check's Trainer rows on one device: MegaStrategy fits of the example GPT, each against a reference
fit on the same device (Lightning's own single-device strategy, or the same strategy without the feature
under test). Run by bench/gpu_check.py; each function returns (passed, figure)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

#: loss tolerance of a row's fits against its reference: the same ops in fp32 (float sums in another order);
#: autocast (a microbatch's shapes change the rounding); QAT (a code may round the other way)
TOL = {"32-true": 1e-5, "16-mixed": 5e-3, "bf16-mixed": 2e-2, "qat": 1e-3}


class Ctx:
    """What every row needs: the device, dry run or not, the model config, the steps, the batches."""

    def __init__(self, cfg, device: torch.device, dry: bool, steps: int = 4, batch: int = 4):
        self.cfg, self.device, self.dry, self.steps, self.batch = cfg, device, dry, steps, batch
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, cfg.vocab_size, (steps * batch, cfg.block_size + 1), generator=g)

    def loader(self, batches=None):
        """The batches in order; ``batches``: only the first ones, every epoch the same."""
        from torch.utils.data import DataLoader, TensorDataset
        d = self.data[:batches * self.batch] if batches else self.data
        return DataLoader(TensorDataset(d[:, :-1], d[:, 1:]), batch_size=self.batch)


def fit(ctx: Ctx, strategy_kw=None, precision="32-true", dropout=0.0, qat=None, batches=None, ckpt_path=None,
        save_at=None, save_to=None):
    """A fit's per-step losses, its module and trainer. ``strategy_kw`` None: Lightning's own strategy;
    ``qat``: the reference gets QAT layers itself; ``save_at``/``save_to``: a checkpoint mid-fit, whose
    module state at that step is returned as the module's ``saved_state``."""
    import lightning as L
    import torch.distributed as dist

    from examples.gpt.lit import LitGPT
    from lightning_tp import MegaStrategy

    seen = {"losses": []}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["losses"].append(float(outputs["loss"]))
            if save_at is not None and trainer.global_step == save_at:
                trainer.save_checkpoint(save_to)
                pl_module.saved_state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}

    L.seed_everything(0, verbose=False)
    c = ctx.cfg
    model = LitGPT(c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, dropout=dropout, lr=1e-3)
    if qat and strategy_kw is None:
        from lightning_tp.quant import apply_qat
        apply_qat(model.model, qat)
    strategy = MegaStrategy(**strategy_kw, timeout=120) if strategy_kw is not None else "auto"
    trainer = L.Trainer(accelerator="cpu" if ctx.dry else "gpu", devices=1, strategy=strategy, precision=precision,
                        max_steps=ctx.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False, callbacks=[Probe()])  # dp = 1: the same batches
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
    try:
        trainer.fit(model, ctx.loader(batches), ckpt_path=ckpt_path)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        if dist.is_initialized():
            dist.destroy_process_group()
    return seen["losses"], model, trainer


def _diff(a: list, b: list) -> float:
    if len(a) != len(b) or not all(map(math.isfinite, a + b)):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _compare(name: str, got: list, ref: list, tol: float, t0: float, extra: str = "") -> tuple:
    d = _diff(got, ref)
    ok = d <= tol and len(got) > 0
    fig = (f"{name}: {len(got)} steps, loss {got[0] if got else math.nan:.4f} -> {got[-1] if got else math.nan:.4f}, "
           f"max |loss - ref| {d:.1e} (tol {tol:.0e}){extra}, {time.perf_counter() - t0:.1f} s")
    return ok, fig


def check_precision(ctx: Ctx, precision: str) -> tuple:
    """MegaStrategy(tp=1) under autocast against Lightning's own strategy under the same precision."""
    t0 = time.perf_counter()
    got, _, trainer = fit(ctx, {}, precision)
    ref, _, _ = fit(ctx, None, precision)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    extra = f", GradScaler scale {scaler.get_scale():.0f}" if scaler is not None else ""
    return _compare(f"MegaStrategy vs Lightning, {precision}", got, ref, TOL[precision], t0, extra)


def check_microbatches(ctx: Ctx) -> tuple:
    """microbatches=2 (the pipeline runner on one stage) against Lightning's own strategy, fp32."""
    t0 = time.perf_counter()
    got, _, trainer = fit(ctx, dict(microbatches=2))
    ref, _, _ = fit(ctx, None)
    runner = type(getattr(trainer.strategy, "runner", None)).__name__
    return _compare(f"microbatches=2 ({runner}) vs Lightning", got, ref, TOL["32-true"], t0)


def check_recompute_dropout(ctx: Ctx) -> tuple:
    """activation_checkpointing=True with dropout against the same fit without: the recompute replays the
    dropout masks (the device's RNG state restored)."""
    t0 = time.perf_counter()
    got, _, _ = fit(ctx, dict(activation_checkpointing=True), dropout=0.1)
    ref, _, _ = fit(ctx, dict(activation_checkpointing=False), dropout=0.1)
    return _compare("checkpointing + dropout 0.1 vs none", got, ref, TOL["32-true"], t0)


def check_quant(ctx: Ctx) -> tuple:
    """MegaStrategy(quant="int8") against Lightning's own strategy on the module given QAT layers by hand."""
    t0 = time.perf_counter()
    got, model, _ = fit(ctx, dict(quant="int8"), qat="int8")
    ref, _, _ = fit(ctx, None, qat="int8")
    layers = sum(type(m).__name__.startswith("QAT") for m in model.modules())
    return _compare(f"quant=int8 ({layers} QAT layers) vs Lightning + apply_qat", got, ref, TOL["qat"], t0)


def check_checkpoint(ctx: Ctx, async_save: bool) -> tuple:
    """A checkpoint at step 2 of 4 (sync or async: training goes on while it is written), resumed: the
    resumed steps against the uninterrupted ones; consolidated: against the module at step 2."""
    from lightning_tp import consolidate

    t0 = time.perf_counter()
    half = ctx.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "step.ckpt")
        kw = dict(async_save=True) if async_save else {}
        # epochs of `half` batches, alike: a resume sees the batches the uninterrupted fit saw, wherever it restarts
        whole, model, _ = fit(ctx, kw, batches=half, save_at=half, save_to=path)
        resumed, _, _ = fit(ctx, kw, batches=half, ckpt_path=path)
        merged = consolidate(path)
    saved = getattr(model, "saved_state", {})
    names = {n for n, _ in model.named_parameters()}
    missing = sorted(names - set(merged))
    worst = max((float((merged[k].float() - v.float()).abs().max()) for k, v in saved.items() if k in merged),
                default=math.inf)
    ok, fig = _compare(f"{'async' if async_save else 'sync'} save at step {half}, resumed", resumed, whole[half:],
                       TOL["32-true"], t0, f"; consolidated vs step {half}: max err {worst:.1e}"
                       + (f", missing {missing[:3]}" if missing else ""))
    return ok and not missing and worst == 0.0, fig


ROWS = {  # check name -> (function, args)
    "trainer fit 16-mixed": (check_precision, ("16-mixed",)),
    "trainer fit bf16-mixed": (check_precision, ("bf16-mixed",)),
    "trainer fit microbatches=2": (check_microbatches, ()),
    "trainer fit checkpointing + dropout": (check_recompute_dropout, ()),
    "trainer fit quant=int8": (check_quant, ()),
    "checkpoint sync: resume + consolidate": (check_checkpoint, (False,)),
    "checkpoint async: resume + consolidate": (check_checkpoint, (True,)),
}
