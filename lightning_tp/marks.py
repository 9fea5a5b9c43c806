"""What a layout stamps on a parameter: one :class:`ParamMarks` per parameter (``p._lightning_tp``),
read with :func:`marks_of` and set with :func:`set_marks`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParamMarks:
    """tp_spec: tp sharding (None: replicated); sp_partial: grad is a per-rank partial sum; pp_tied,
    pp_tied_index, pp_copy: held on several stages, grads summed; pp_late_sync: no single backward
    finalizes its grad; expert: one of this rank's experts (grads averaged over expert-dp ranks)."""

    tp_spec: Optional[Any] = None
    sp_partial: bool = False
    pp_tied: bool = False
    pp_tied_index: int = 0
    pp_copy: bool = False
    pp_late_sync: bool = False
    expert: bool = False


UNMARKED = ParamMarks()


def marks_of(param) -> ParamMarks:
    return getattr(param, "_lightning_tp", UNMARKED)


def set_marks(param, **changes):
    """Set some of ``param``'s marks (the others kept); returns ``param``."""
    param._lightning_tp = dataclasses.replace(marks_of(param), **changes)
    return param
