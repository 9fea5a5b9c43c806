"""Per-family parallelization plans and the code that applies them."""

from .base import STYLES, Plan
from .registry import register_plan, registered_plans

__all__ = ["Plan", "STYLES", "register_plan", "registered_plans"]
