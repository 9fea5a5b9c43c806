"""A model with its own attention class: plan="auto" refuses it and names the classes; a user plan
(plain dicts, as LightningCLI YAML gives) trains it to the single-process numbers."""

import warnings

import pytest

from helpers import check, train_launch
from lightning_tp import Plan
from lightning_tp.plans import checks
from models import CUSTOM_PLAN, make_model

WORLD2 = {
    "custom_tp2": ("custom", {}, dict(tp=2, plan=CUSTOM_PLAN), {}),
    "custom_tp2_sp": ("custom", {}, dict(tp=2, sp=True, plan=CUSTOM_PLAN), {}),
    "custom_pp2": ("custom", {}, dict(pp=2, microbatches=2, plan=CUSTOM_PLAN), {}),
}


def test_auto_plan_refuses_and_lists_the_classes():
    with pytest.raises(ValueError) as err:
        checks.resolve(make_model("custom"), 2, False, "auto")
    for word in ("no parallelization plan", "CustomLM", "MyAttention", "MyBlock", "plan="):
        assert word in str(err.value)


def test_validation_reports_unmatched_globs_and_unsharded_linears():
    plan = dict(CUSTOM_PLAN, styles={**CUSTOM_PLAN["styles"], "blocks.*.gate": "colwise"})
    del plan["styles"]["blocks.*.up"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks.resolve(make_model("custom"), 2, False, Plan.from_dict(plan))
    text = " ".join(str(w.message) for w in caught)
    assert "blocks.*.gate" in text and "matched nothing" in text
    assert "blocks.0.up" in text and "left unsharded" in text


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, WORLD2, tmp_path_factory, "user")


@pytest.mark.parametrize("name", list(WORLD2))
def test_user_plan_parity(world2, name):
    check(world2, name, WORLD2, 2)
