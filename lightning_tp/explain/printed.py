"""The printed form of an explain report (see .explain): the layout, per-rank figures, memory and
collectives, pipeline notes."""

from __future__ import annotations


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_memory(rep) -> list:
    """The report's lines on weights, gradients and optimizer state per rank, and the gradient collectives."""
    c = rep.config
    zero, sharded = c["zero"], c["zero"] and c["dp"] > 1
    lines = ["", f"Memory per rank, zero={zero} (weights and gradients at {c['grad_bytes']} B/element, optimizer state "
                 f"{c['optimizer_state_bytes']} B per trained element, by default AdamW's two moments), and the "
                 f"gradient collectives per optimizer step:",
             f"  {'stage':>5} {'tp':>3} {'weights':>11} {'grads':>11} {'optim state':>12}  dp collectives"]
    for r in rep.ranks:
        ops = ", ".join(f"{n} x {op}{' (expert-dp)' if g == 'edp' else ''} {size(b)}" for op, g, n, b in r.dp_ops)
        lines.append(f"  {r.stage:>5} {r.tp_rank:>3} {size(r.weight_bytes):>11} {size(r.grad_held_bytes):>11} "
                     f"{size(r.optim_state_bytes):>12}  {ops or '-'}")
    if sharded and zero == 3:
        lines.append(f"(zero=3, FSDP2: weights, grads and optim state are dp rank 0's shards, ceil(rows / dp) of each "
                     f"tensor; each block's weights are all-gathered for its forward and again for its backward, the "
                     f"rest of the model's once a step, up to {size(max(r.weight_gathered_bytes for r in rep.ranks))} "
                     f"whole at once; the backward makes a block's whole gradients at a time, up to "
                     f"{size(max(r.grad_whole_bytes for r in rep.ranks))}, and reduce-scatters them)")
    elif sharded:
        lines.append(f"(zero=1: grads and optim state are what dp rank 0 holds at the optimizer step, its 1/dp slice of "
                     f"each bucket (up to 25 MiB, padded to a multiple of dp); the backward still makes whole "
                     f"gradients, up to {size(max(r.grad_whole_bytes for r in rep.ranks))}, before the reduce-scatter; "
                     f"weights stay whole, the all-gather brings the stepped slices back (DP grads above: both); the "
                     f"reduce-scatter also sends one has-a-gradient flag per parameter in each rank's range)")
    elif zero:
        lines.append(f"(zero={zero} at dp=1: nothing is sharded)")
    elif c["dp"] > 1:
        lines.append("(zero=0: every dp rank holds whole gradients and optimizer state; one all-reduce per bucket of "
                     "gradients, one has-a-gradient flag per parameter included)")
    return lines


def _split_note(fns, deferred) -> str:
    """What a split backward does with one block class's weights (see .split_backward)."""
    if fns is None:
        return "decided at the first step (a block did not run alone on its hidden states)"
    if fns == ["CompiledFunctionBackward"] and not deferred:
        return "a compiled region: B runs the whole backward"
    note = f"weights of {deferred} group{'s' * (deferred != 1)} deferred to W"
    if fns:
        note += f"; taken in B with the input gradient: {', '.join(fns)} (a custom Function computing both)"
    return note


def format_report(rep) -> str:
    """The printed report of an :class:`~lightning_tp.explain.Explanation`."""
    c = rep.config
    pipelined = c["pp"] > 1 or c["microbatches"] > 1
    cp = f" cp={c['cp']}" if c.get("cp", 1) > 1 else ""
    head = f"lightning_tp explain: tp={c['tp']} pp={c['pp']} dp={c['dp']}{cp} (world {c['world']}) sp={c['sp']}"
    if pipelined:
        head += f" microbatches={c['microbatches']} schedule={c['schedule']}"
        head += f" virtual_stages={c['virtual_stages']}" if c["virtual_stages"] > 1 else ""
    lines = [head,
             f"batch {c['batch_shape'][0]} x {c['batch_shape'][1]} per process, hidden {c['hidden']}, "
             f"{c['dtype_bytes']} B/activation element, {c['grad_bytes']} B/grad element, "
             f"accumulate_grad_batches={c['accumulate_grad_batches']}", "",
             "Plan" + ("" if c["tp"] > 1 else " (tp=1: not applied)") + ": "
             + ", ".join(f"{name} at {prefix or '<root>'}" for prefix, name in c["plans"])]
    lines += [f"  {p:<44} {s:<14}" + (f" x{n}" if n > 1 else "") for p, s, n in rep.styles]
    for ops, what in ((rep.layer_ops, "one block" if not rep.decoder_ops else "an encoder block"),
                      (rep.decoder_ops, "a decoder block")):
        if ops:
            counts = {}
            for op in ops:
                counts[op] = counts.get(op, 0) + 1
            lines.append(f"  TP collectives of {what}, elements recorded per token: "
                         + ", ".join(f"{n} x {op} {w:g} ({phase})" for (op, w, phase), n in counts.items()))
    if rep.stages and c["pp"] > 1:
        lines += ["", f"Stages (blocks of {c['blocks']}):"]
        lines += [f"  virtual stage {k} on pp rank {r}: blocks {lo}..{hi} ({hi - lo + 1})"
                  for k, r, lo, hi in rep.stages]
        lines.append(f"  first stage also holds: {', '.join(rep.outer['first']) or '-'}; "
                     f"last stage: {', '.join(rep.outer['last']) or '-'}")
        if rep.decoder_ops:  # an encoder-decoder (see StageLayout.runs)
            lines.append(f"  the stage of the decoder's first block holds a copy of the first stage's modules "
                         f"for the decoder's input; "
                         f"two stages run what lies between the lists ({', '.join(rep.outer['between']) or '-'}: the "
                         f"encoder's on its last block's, the decoder's on its first's); a decoder stage sends "
                         f"the encoder's output with its hidden states")
    if c["pp"] > 1:
        split = {True: "; every backward split, input half first", "drain": "; the backwards after each stage's "
                 "last forward split, input half first (split_backward)"}.get(c.get("split_backward"), "")
        lines.append(f"  pipeline bubble: {c['bubble']:.1%} of a step idle on each stage (equal blocks, backward = 2 "
                     f"forwards, free transfers{split}; more microbatches or virtual stages shrink it)")
        lines += [f"  split backward: {name}: {_split_note(fns, rep.split_deferred.get(name))}"
                  for name, fns in rep.split_in_b.items()]
    lines += ["", "Per rank, per optimizer step (bytes = recorded elements x element size: the payload each rank "
              "passes to a collective or send, not ring wire bytes):",
              f"  {'stage':>5} {'tp':>3} {'params':>12} {'TP act':>11} {'PP send':>11} {'SP grads':>10} "
              f"{'tied':>10} {'DP grads':>11} {'act mem':>11} {'peak mb':>7}"]
    for r in rep.ranks:
        lines.append(f"  {r.stage:>5} {r.tp_rank:>3} {r.params:>12,} {size(r.tp_bytes):>11} {size(r.pp_bytes):>11} "
                     f"{size(r.sp_bytes):>10} {size(r.tied_bytes):>10} {size(r.dp_bytes):>11} "
                     f"{size(r.act_bytes):>11} {r.peak_microbatches:>7}")
    lines.append("(act mem: estimated activations saved for backward; see lightning_tp/explain/estimate.py for the model)")
    lines += format_memory(rep)
    if c.get("cp", 1) > 1:
        lines += ["", f"Context parallelism (cp={c['cp']}, {c['cp_attention']}): each rank holds 1/{c['cp']} of every "
                      f"sequence (act mem above); the ring's sends per rank and step: "
                      + ", ".join(sorted({size(r.cp_bytes) for r in rep.ranks}))]
        if rep.cp_flop_per_byte:
            lines.append(f"  overlap: each ring step computes {rep.cp_flop_per_byte:,.0f} attention FLOP per byte it sends "
                         f"(the lower of forward and backward); the transfer hides behind the attention where the "
                         f"device's attention FLOP/s over the link's bytes/s is below that (e.g. 400 TFLOP/s over "
                         f"450 GB/s NVLink: ~900; over 50 GB/s InfiniBand: ~8,000). Longer sequences raise it.")
    if c.get("ep", 1) > 1 or c.get("etp", 1) > 1:
        lines += ["", f"Experts (ep={c['ep']}{', etp=' + str(c['etp']) if c.get('etp', 1) > 1 else ''}): per rank, per optimizer step (all-to-all: rows out and back, forward "
                      f"and backward, balanced routing assumed):",
                  f"  {'stage':>5} {'tp':>3} {'expert params':>14} {'all-to-all':>11} {'expert-dp grads':>16}"]
        lines += [f"  {r.stage:>5} {r.tp_rank:>3} {r.expert_params:>14,} {size(r.ep_bytes):>11} {size(r.edp_bytes):>16}"
                  for r in rep.ranks]
    if c["activation_checkpointing"]:
        n = c["activation_checkpointing"]
        lines.append(f"(activation checkpointing: {'every block' if n is True else f'the first {n} blocks of each stage'}"
                     f" keeps its input only; act mem includes one block's recompute, up to "
                     f"{size(max(r.recompute_bytes for r in rep.ranks))}; TP act counts its forward collectives "
                     f"twice, at most {size(max(r.tp_recompute_bytes for r in rep.ranks))} more)")
    if c.get("selective"):
        lines.append(f"(selective recomputation: each block's attention core keeps only its inputs; act mem includes "
                     f"one core's s x s tensors during its recompute, up to {size(max(r.recompute_bytes for r in rep.ranks))}"
                     f"{'' if c.get('score_copies') else ' (score_copies=0: fused attention keeps none anyway)'})")
    return "\n".join(lines)
