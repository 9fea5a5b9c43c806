"""The printed form of a plan: the ranked table, why the best few win, and what overflows in those
that do not fit."""

from __future__ import annotations

TOP, WHY = 15, 3


def _layout(c) -> str:
    ckpt = {False: "-", "selective": "sel", True: "full"}[c.activation_checkpointing]
    sched = {"1f1b": "1f1b", "interleaved_1f1b": f"int{c.virtual_stages}"}[c.schedule] if c.pp > 1 else "-"
    return (f"{c.tp:>3}{'+sp' if c.sp else '   '} {c.pp:>3} {c.dp:>4} {c.microbatch_size:>3}x{c.microbatches:<4} "
            f"{sched:>6} {ckpt:>5} {c.zero:>4} {c.ep:>3} {c.cp:>3}")


def format_plan(p) -> str:
    cl = p.cluster
    lines = [f"lightning_tp plan: {cl.gpus} GPUs ({cl.gpus_per_node} a node, {cl.gpu_memory_gib:g} GiB, "
             f"{cl.peak_tflops:g} TFLOP/s), {len(p.fits)} layouts fit, {len(p.overflows)} do not",
             f"  {'tp':>6} {'pp':>3} {'dp':>4} {'mb x m':>8} {'sched':>6} {'recmp':>5} {'zero':>4} {'ep':>3} {'cp':>3} "
             f"{'GiB':>6} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'HW TFLOP/s':>10}"]
    for c in p.fits[:TOP]:
        lines.append(f"  {_layout(c)} {c.memory_gib:>6.1f} {c.step_s:>8.3f} {c.tokens_per_s:>10.0f} {c.mfu:>6.1%} "
                     f"{c.hardware_tflops:>10.1f}")
    for i, c in enumerate(p.fits[:WHY]):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c.why.items(), key=lambda kv: -kv[1]) if v > 0)
        lines.append(f"#{i + 1}: {parts} s; memory headroom {cl.gpu_memory_gib - c.memory_gib:.1f} GiB")
    lines += p.left_out
    if p.overflows:
        c = p.overflows[0]
        lines.append(f"smallest that does not fit: {_layout(c).strip()}: {c.overflow}")
    return "\n".join(lines)
