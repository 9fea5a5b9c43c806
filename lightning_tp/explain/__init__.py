"""explain(): what a MegaStrategy layout will hold and send, before any process starts (estimate.py), its
per-module costs (costs.py), the split backward's B share (split_backward.py) and its printed form (printed.py)."""

from .estimate import Explanation, explain

__all__ = ["Explanation", "explain"]
