"""The driver's check that a rollout batch carries one support row per response token (batch_check.py: no verl
import, so it runs in the main suite); its installation on RayPPOTrainer is in test_driver.py (needs verl)."""
import numpy as np
import pytest

from mask_replay.errors import InputError
from mask_replay.integrations.verl.batch_check import check_batch_supports, response_lengths
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY


def support(rows: int) -> dict:
    return {"token_ids": np.arange(2 * rows, dtype=np.int32), "offsets": np.arange(0, 2 * rows + 1, 2, dtype=np.int64)}


def batch(*rows):
    return {SUPPORT_KEY: np.array([support(r) if r is not None else None for r in rows], dtype=object)}


def test_response_lengths_are_the_attention_mask_over_the_response_columns():
    mask = np.array([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]])
    assert response_lengths(mask, 3).tolist() == [2, 3, 0]


def test_a_batch_with_a_row_per_response_token_passes():
    assert check_batch_supports(batch(3, 5, 1), [3, 5, 1]) is None


def test_an_empty_response_needs_no_support():
    assert check_batch_supports(batch(2, None), [2, 0]) is None


def test_a_batch_without_supports_names_the_setting():
    with pytest.raises(InputError, match="MASK_REPLAY_VERL=1 but the rollout batch carries no 'sampling_support'") as e:
        check_batch_supports({"uid": np.array(["a", "b"])}, [3, 4])
    assert e.value.key == "MASK_REPLAY_VERL"
    assert "every Ray worker" in str(e.value)


def test_a_sample_with_fewer_rows_than_tokens_is_refused():
    with pytest.raises(InputError, match="sample 1 has 5 response tokens but 4 support rows") as e:
        check_batch_supports(batch(3, 4), [3, 5])
    assert e.value.key == "MASK_REPLAY_VERL"


def test_a_sample_without_a_record_is_refused():
    with pytest.raises(InputError, match="sample 0 has 2 response tokens but no recorded support"):
        check_batch_supports(batch(None, 3), [2, 3])


def test_a_record_without_offsets_is_refused():
    bad = {SUPPORT_KEY: np.array([{"token_ids": np.zeros(2, np.int32)}], dtype=object)}
    with pytest.raises(InputError, match="sample 0 has 2 response tokens but no recorded support"):
        check_batch_supports(bad, [2])


def test_a_count_mismatch_between_supports_and_responses_is_refused():
    with pytest.raises(InputError, match="the batch has 3 responses but 2 'sampling_support' entries"):
        check_batch_supports(batch(1, 1), [1, 1, 1])


def test_a_bad_attention_mask_is_refused():
    with pytest.raises(InputError, match="attention_mask of shape"):
        response_lengths(np.ones(4), 2)
