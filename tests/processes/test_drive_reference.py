"""The drive's reference check at the precision the stages run: two int4 workers are judged
against a reference computed stage by stage at int4 (what a deploy pinned to int4 runs), not
against bf16 with bf16's tolerance."""
from __future__ import annotations

import pytest
import torch

from helpers import local_pipeline

from layerline.driver import DriveError, DriveOptions, drive, reference_forward


@pytest.fixture(scope="module")
def int4_pipeline(small_ckpt):
    with local_pipeline(small_ckpt, 2, "int4", policy="uniform") as pipe:
        yield pipe


PROMPT = [3, 17, 42, 99, 7, 250, 12, 8, 61, 5]


def test_int4_stages_match_a_stage_by_stage_int4_reference(small_ckpt, int4_pipeline):
    stages = [(0, 2, "int4"), (2, 4, "int4")]   # uniform over 2 stages of the 4-layer model
    res = drive(int4_pipeline, [PROMPT], DriveOptions(reference=str(small_ckpt), precision="bf16", stages=stages))
    assert res.check["precision"] == "int4"
    assert res.check["ok"], res.check
    # the plan-wide precision alone (bf16) is another model: the check would compare the wrong thing
    bf16, _ = reference_forward(str(small_ckpt), torch.tensor([PROMPT]), None, "bf16")
    int4, _ = reference_forward(str(small_ckpt), torch.tensor([PROMPT]), stages, "bf16")
    assert float((bf16.float() - int4.float()).abs().max()) > res.check["max_abs_diff"]


def test_stages_that_do_not_cover_the_model_are_one_clear_error(small_ckpt):
    with pytest.raises(DriveError, match="must cover layers 0..4"):
        reference_forward(str(small_ckpt), torch.tensor([PROMPT]), [(0, 2, "int4"), (3, 4, "int4")], "bf16")
