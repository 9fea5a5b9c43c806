"""Built-in plans, searched in order by ``plan="auto"``; more specific families first."""

from __future__ import annotations

from .base import Plan

_USER: list = []


def register_plan(plan: Plan) -> Plan:
    """Add a plan that ``plan="auto"`` finds by its ``targets`` (checked before the built-in ones)."""
    _USER.insert(0, plan)
    return plan


def registered_plans() -> list:
    from . import falcon, gpt, hf, hf_seq2seq, litgpt, torch_transformer

    return _USER + gpt.PLANS + hf.PLANS + falcon.PLANS + hf_seq2seq.PLANS + litgpt.PLANS + torch_transformer.PLANS
