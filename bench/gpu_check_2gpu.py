"""The checks that need two GPUs (NCCL across processes), in one launch of 2 processes; prints one table.

    bench/gpu_check_2gpu.sh                 # on a machine with 2 CUDA GPUs
    bench/gpu_check_2gpu.sh --cpu-dry-run   # the same on CPU: gloo, 2 processes, tiny sizes

Rows: the raw collectives the strategy uses, each against its exact result; then MegaStrategy fits on 2
devices of the example GPT, each against a reference fit (one device, Lightning's own strategy, the same
global batches; or, where stated, another 2-device layout). Exit status 1 when a row FAILs."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--cpu-dry-run", action="store_true", help="gloo on CPU, 2 processes, tiny sizes")
ap.add_argument("--only", default="", help="run only the layouts whose name has this substring")
ap.add_argument("--timeout", type=float, default=90.0, help="seconds for each launch's collectives (default 90)")
ARGS = ap.parse_args()
if ARGS.cpu_dry_run:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

from lightning_tp.testing import free_port  # noqa: E402

DRY = ARGS.cpu_dry_run
TOL = {"32-true": 1e-5, "16-mixed": 5e-3, "bf16-mixed": 2e-2, "qat": 1e-3}
G = 8  # global batch (samples a step over all data-parallel ranks)

# name -> (strategy kwargs, precision, model kwargs, options); options: ref = "single" (one device, Lightning)
# or another layout's name; freeze: the first stage's modules frozen; clip; last: a smaller last batch
LAYOUTS = {
    "tp=2 sp clip": (dict(tp=2, sp=True), "32-true", {}, dict(clip=0.05)),
    **{f"pp=2 {s} frozen stage 0 + clip, small last batch": (
        dict(pp=2, microbatches=2, schedule=s, **(dict(virtual_stages=2) if s.startswith("interleaved") else {})),
        "32-true", dict(n_layer=4), dict(clip=0.05, freeze=True, last=True)) for s in ("1f1b", "interleaved_1f1b", "zb_h1")},
    "zero=1 16-mixed fused AdamW": (dict(zero=1), "16-mixed", {}, dict(fused=True)),
    "ep=2 dropless": (dict(ep=2), "32-true", dict(n_expert=4), {}),
    "ep=2 capacity 1.25": (dict(ep=2, moe_capacity=1.25), "32-true", dict(n_expert=4), dict(ref="ep=1 capacity 1.25")),
    "ep=1 capacity 1.25": (dict(moe_capacity=1.25), "32-true", dict(n_expert=4), dict(ref=None)),
    "tp=2 kernels": (dict(tp=2, kernels=True), "32-true", {}, {}),
    "tp=2 quant=int8": (dict(tp=2, quant="int8"), "32-true", {}, dict(qat="int8")),
    # context parallelism: each GPU holds half of every sequence; K/V around the ring (NCCL p2p), or all-to-all
    "cp=2 ring": (dict(cp=2), "32-true", {}, {}),
    "cp=2 all_to_all bf16-mixed": (dict(cp=2, cp_attention="all_to_all"), "bf16-mixed", {}, {}),
}
RESUMES = ("tp=2", "pp=2")  # zero=3 bf16 checkpoints (sync, async) resumed at these layouts


def cfg():
    from examples.gpt.model import GPTConfig
    if DRY:
        return GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)


def data(steps: int):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg().vocab_size, (steps * G, cfg().block_size + 1), generator=g)


def fit(strategy_kw, precision, model_kw, opts, steps, devices, rank=0, batches=None, ckpt_path=None,
        save_at=None, save_to=None):
    """Per-step losses (the logged, dp-averaged ``train_loss``) of one fit; ``strategy_kw`` None: one device."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from examples.gpt.lit import LitGPT
    from lightning_tp import MegaStrategy

    c, losses = cfg(), []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train_loss"]))

        def on_train_epoch_end(self, trainer, pl_module):  # where ModelCheckpoint saves
            if save_at is not None and trainer.global_step == save_at:
                trainer.save_checkpoint(save_to)

    class GPT(LitGPT):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=bool(opts.get("fused")))

    L.seed_everything(0, verbose=False)
    kw = dict(vocab_size=c.vocab_size, block_size=c.block_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd)
    model = GPT(**{**kw, **model_kw})
    if opts.get("freeze"):  # what pp=2 puts on its first stage: the embeddings and the first half of the blocks
        t = model.model.transformer
        for m in [t.wte, t.wpe, *t.h[: len(t.h) // 2]]:
            m.requires_grad_(False)
    if opts.get("qat") and strategy_kw is None:
        from lightning_tp.quant import apply_qat
        apply_qat(model.model, opts["qat"])
    d = data(steps)
    if batches:
        d = d[: batches * G]
    if opts.get("last"):
        d = d[: len(d) - G // 2]  # the last batch half the others
    single = strategy_kw is None
    dp = 1 if single else devices // (strategy_kw.get("tp", 1) * strategy_kw.get("pp", 1) * strategy_kw.get("cp", 1))
    if dp > 1:  # this rank's share of each global batch (rank = dp rank: tp = pp = 1 here)
        b = G // dp
        d = torch.cat([d[k + rank * b: k + (rank + 1) * b] for k in range(0, len(d), G)])
    trainer = L.Trainer(accelerator="cpu" if DRY else "gpu", devices=1 if single else devices,
                        strategy="auto" if single else MegaStrategy(**strategy_kw, timeout=ARGS.timeout),
                        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=opts.get("clip"), callbacks=[Probe()], use_distributed_sampler=False)
    trainer.fit(model, DataLoader(TensorDataset(d[:, :-1], d[:, 1:]), batch_size=G // dp), ckpt_path=ckpt_path)
    return losses


def primitives(rank: int, device) -> dict:
    """Each raw collective against its exact result: {name: ok}."""
    import torch.distributed as dist

    out, world = {}, 2
    t = torch.arange(3, dtype=torch.float32, device=device) + 10 * rank
    got = torch.empty(6, device=device)
    dist.all_gather_into_tensor(got, t)
    out["all_gather_into_tensor"] = got.tolist() == [0, 1, 2, 10, 11, 12]
    try:
        mine = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(mine, torch.arange(4, dtype=torch.float32, device=device) * (rank + 1))
        out["reduce_scatter_tensor"] = mine.tolist() == ([0, 3] if rank == 0 else [6, 9])
    except RuntimeError as e:  # gloo in some torch versions
        out["reduce_scatter_tensor"] = "unsupported" if DRY else False
        print(f"reduce_scatter_tensor: {e}", file=sys.stderr)
    splits_in = [1, 2] if rank == 0 else [3, 1]  # uneven: rank r sends splits_in[j] rows to rank j
    x = torch.full((sum(splits_in),), float(rank), device=device)
    splits_out = [1, 3] if rank == 0 else [2, 1]
    y = torch.empty(sum(splits_out), device=device)
    dist.all_to_all_single(y, x, splits_out, splits_in)
    out["all_to_all_single uneven"] = y.tolist() == ([0, 1, 1, 1] if rank == 0 else [0, 0, 1])
    peer = 1 - rank
    send_f, send_i = torch.full((4,), float(rank), device=device), torch.full((2,), rank + 5, device=device)
    recv_f, recv_i = torch.empty(4, device=device), torch.empty(2, dtype=torch.int64, device=device)
    ops = [dist.P2POp(dist.isend, send_f, peer), dist.P2POp(dist.irecv, recv_f, peer),
           dist.P2POp(dist.isend, send_i, peer), dist.P2POp(dist.irecv, recv_i, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv mixed dtypes"] = recv_f.tolist() == [float(peer)] * 4 and recv_i.tolist() == [peer + 5] * 2
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=ARGS.timeout))
    obj = [{"rank0": [1, 2]} if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0, group=sub, device=device)
    out["broadcast_object_list (subgroup)"] = obj[0] == {"rank0": [1, 2]}
    return out


def _port(rank: int, outdir: str) -> int:
    """The rendezvous port: rank 0 picks a free one once both processes are up, and hands it over in a file.
    Picked in the parent, it stayed free through the processes' imports, long enough for another program
    to take it (every init then timed out on that program's socket)."""
    path = Path(outdir) / "port"
    if rank == 0:
        port = free_port()
        path.with_suffix(".tmp").write_text(str(port))
        path.with_suffix(".tmp").rename(path)
        return port
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 wrote no rendezvous port in 300 s")
        time.sleep(0.05)
    return int(path.read_text())


def worker(rank: int, outdir: str, steps: int) -> None:
    """One of the 2 processes: the primitives, then every layout and the zero=3 checkpoints; results to a file."""
    import torch.distributed as dist

    port = _port(rank, outdir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", PL_DISABLE_FORK="1")
    torch.set_num_threads(1)
    device = torch.device("cpu") if DRY else torch.device("cuda", rank)
    res = {}
    try:
        if not DRY:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if DRY else "nccl", timeout=timedelta(seconds=ARGS.timeout),
                                **({} if DRY else dict(device_id=device)))
        res["primitives"] = primitives(rank, device)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported as the row's failure
        res["primitives"] = traceback.format_exc()
    for name, (skw, prec, mkw, opts) in LAYOUTS.items():
        if ARGS.only not in name:
            continue
        try:
            res[name] = fit(skw, prec, mkw, opts, steps, 2, rank)
        except Exception:  # noqa: BLE001
            res[name] = traceback.format_exc()
    half = max(1, steps // 2)
    for mode in ("sync", "async"):
        ck = str(Path(outdir) / f"zero3_{mode}.ckpt")
        extra = dict(async_save=True) if mode == "async" else {}
        try:  # epochs of `half` batches, alike: a resume sees the batches the uninterrupted fit saw
            res[f"zero=3 bf16 {mode}"] = fit(dict(zero=3, **extra), "bf16-mixed", {}, {}, steps, 2, rank,
                                             batches=half, save_at=half, save_to=ck)
        except Exception:  # noqa: BLE001
            res[f"zero=3 bf16 {mode}"] = traceback.format_exc()
        for layout in RESUMES:
            skw = dict(tp=2) if layout == "tp=2" else dict(pp=2, microbatches=2)
            try:
                res[f"zero=3 bf16 {mode} -> {layout}"] = fit(skw, "bf16-mixed", {}, {}, steps, 2, rank,
                                                             batches=half, ckpt_path=ck)
            except Exception:  # noqa: BLE001
                res[f"zero=3 bf16 {mode} -> {layout}"] = traceback.format_exc()
    torch.save(res, os.path.join(outdir, f"{rank}.pt"))


def _diff(a, b) -> float:
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not all(map(math.isfinite, a + b)):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def rows(res: dict, steps: int) -> list:
    """(check, PASS/FAIL, figure) of every row, references fitted here on one device."""
    out = []
    prims = res["primitives"]
    if isinstance(prims, str):
        out.append(("primitives", "FAIL", prims.strip().splitlines()[-1][:160]))
    else:
        for k, ok in prims.items():
            out.append((f"primitive {k}", "SKIP" if ok == "unsupported" else ("PASS" if ok else "FAIL"),
                        "gloo lacks it" if ok == "unsupported" else ("exact" if ok else "WRONG")))
    for name, (skw, prec, mkw, opts) in LAYOUTS.items():
        ref_name = opts.get("ref", "single")
        if ref_name is None or name not in res:
            continue  # a reference of another row, or not run (--only)
        got = res[name]
        if isinstance(got, str):
            out.append((name, "FAIL", got.strip().splitlines()[-1][:160]))
            continue
        if ref_name == "single":
            ref, what = fit(None, prec, mkw, opts, steps, 1), "one device"
        else:
            ref, what = res[ref_name], ref_name
        tol = TOL["qat"] if opts.get("qat") else TOL[prec]
        d = _diff(got, ref)
        out.append((name, "PASS" if d <= tol else "FAIL",
                    f"{len(got)} steps, loss {got[0]:.4f} -> {got[-1]:.4f}, max |loss - {what}| {d:.1e} (tol {tol:.0e})"))
    half = max(1, steps // 2)
    for mode in ("sync", "async"):
        whole = res[f"zero=3 bf16 {mode}"]
        for layout in RESUMES:
            name, got = f"zero=3 bf16 {mode} ckpt -> {layout}", res[f"zero=3 bf16 {mode} -> {layout}"]
            bad = next((r for r in (whole, got) if isinstance(r, str)), None)
            if bad is not None:
                out.append((name, "FAIL", bad.strip().splitlines()[-1][:160]))
                continue
            d = _diff(got, whole[half:])
            out.append((name, "PASS" if d <= TOL["bf16-mixed"] else "FAIL",
                        f"resumed {len(got)} steps vs the zero=3 fit's last {len(whole[half:])}: max |loss diff| "
                        f"{d:.1e} (tol 2e-02)"))
    return out


def main() -> int:
    import torch.multiprocessing as mp

    if not DRY and torch.cuda.device_count() < 2:
        print("gpu_check_2gpu: needs 2 GPUs (or --cpu-dry-run)", file=sys.stderr)
        return 2
    steps, t0 = (2 if DRY else 4), time.perf_counter()
    with tempfile.TemporaryDirectory() as outdir:
        # CUDA needs fresh processes; the dry run forks (the imports made once, as bench/_smoke.py's children do)
        mp.start_processes(worker, args=(outdir, steps), nprocs=2, start_method="fork" if DRY else "spawn", join=True)
        res = torch.load(os.path.join(outdir, "0.pt"), weights_only=True)
    table = rows(res, steps)
    fails = sum(r[1] == "FAIL" for r in table)
    table.append(("total", "FAIL" if fails else "PASS", f"{time.perf_counter() - t0:.1f} s wall; {fails} fail"))
    w = max(len(r[0]) for r in table)
    for check, result, fig in table:
        print(f"| {check:{w}s} | {result:4s} | {fig} |")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
