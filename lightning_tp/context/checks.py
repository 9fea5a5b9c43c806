"""What context parallelism refuses before any process group: unknown attention modes and the
combinations not built yet (each error says what to set instead)."""

from __future__ import annotations

CP_ATTENTION = ("ring", "all_to_all")


def check_context_parallel(cp: int, cp_attention: str, ep: int = 1, zero: int = 0, broadcast_batch: bool = True) -> None:
    """The same errors on every rank, before any collective."""
    if cp_attention not in CP_ATTENTION:
        raise ValueError(f"MegaStrategy(cp_attention={cp_attention!r}): choose 'ring' (K/V passed around the cp "
                         f"ranks) or 'all_to_all' (heads scattered, sequence gathered).")
    if cp == 1:
        return
    if zero == 3:
        raise ValueError(f"MegaStrategy(cp={cp}, zero=3) is not supported yet: zero=3 shards over dp only. Use "
                         f"zero=1 (sharded over dp x cp) or zero=0.")
    if not broadcast_batch:
        raise ValueError(f"MegaStrategy(cp={cp}) needs broadcast_batch=True: the cp ranks of a replica cut one "
                         f"batch, so they must hold the same one.")
