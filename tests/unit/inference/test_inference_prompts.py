"""Overlong prompts: truncated (keeping the end) or rejected, counted, never an exception for the batch."""

import pytest

from mrl.inference.prompt_limits import fit_prompts, max_prompt_tokens


def test_truncate_keeps_the_last_tokens_and_counts():
    fitted = fit_prompts([[1, 2, 3], [1, 2, 3, 4, 5, 6], [7]], limit=4, policy="truncate")
    assert fitted.token_ids == [[1, 2, 3], [3, 4, 5, 6], [7]]
    assert fitted.indices == [0, 1, 2]
    assert fitted.truncated == {1} and fitted.rejected == set()


def test_reject_drops_and_counts():
    fitted = fit_prompts([[1, 2, 3, 4, 5], [1, 2], [9] * 4], limit=4, policy="reject")
    assert fitted.token_ids == [[1, 2], [9] * 4]
    assert fitted.indices == [1, 2]
    assert fitted.rejected == {0} and fitted.truncated == set()


def test_empty_prompt_is_rejected_whatever_the_policy():
    for policy in ("truncate", "reject"):
        assert fit_prompts([[], [1]], limit=4, policy=policy).rejected == {0}


def test_prompt_limit_leaves_room_for_the_response():
    assert max_prompt_tokens(128, 32) == 96
    with pytest.raises(ValueError, match="max_new_tokens=128"):
        max_prompt_tokens(128, 128)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="'truncate' or 'reject'"):
        fit_prompts([[1]], limit=4, policy="drop")  # type: ignore[arg-type]
