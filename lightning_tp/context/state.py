"""The process's active context-parallel run (None outside one), read by the swapped torch functions."""

from __future__ import annotations

_ACTIVE = None


def active():
    return _ACTIVE


def set_active(run) -> None:
    global _ACTIVE
    _ACTIVE = run
