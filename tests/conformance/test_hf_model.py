"""The optional HuggingFace path (`pip install gradparity[hf]`, tox env `hf`): a GPT-2 built from
its config, dropout on, through `check_model` on torch DDP and refimpl's DDP. Skipped where
transformers is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

MOD = "tests.conformance.hf_models"


@pytest.mark.slow
def test_a_huggingface_gpt2_with_dropout_trains_like_one_process(session):
    from conformance import check_model

    result = check_model(f"{MOD}:build", f"{MOD}:batch", f"{MOD}:loss", adapters=["torch-ddp", "refimpl-ddp"],
                         world_sizes=[2], families=["plain", "no-sync", "autocast-bf16"], executor=session)
    assert result.ok, result.summary
    assert any("dropout" in note for note in result.notes)
