"""The sharding contract of WorkerGroup.shard_and_run: split along axis 0, replicate the rest, merge back."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mrl.distributed.batch import batch_size, merge_shards, replicated_field, shard_bounds, split_batch


@dataclass
class Rollouts:
    tokens: torch.Tensor  # [B, T]
    rewards: np.ndarray  # [B]
    texts: list
    temperature: float
    bias: torch.Tensor = replicated_field(default=None)  # [V], every rank needs all of it

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor):
            raise TypeError("tokens must be a tensor")


def _rollouts(rows: int) -> Rollouts:
    return Rollouts(
        tokens=torch.arange(rows * 3).reshape(rows, 3),
        rewards=np.arange(rows, dtype=np.float32) / 10,
        texts=[f"t{i}" for i in range(rows)],
        temperature=0.7,
        bias=torch.ones(5),
    )


def test_even_split_gives_contiguous_blocks_and_replicates_the_rest():
    shards = split_batch({"x": torch.arange(12).reshape(6, 2), "step": 3, "names": list("abcdef")}, 3)
    assert [shard["x"][:, 0].tolist() for shard in shards] == [[0, 2], [4, 6], [8, 10]]
    assert [shard["names"] for shard in shards] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(shard["step"] == 3 for shard in shards)


def test_uneven_split_needs_permission_and_gives_first_shards_the_extra_rows():
    with pytest.raises(ValueError, match="5 rows does not split evenly over 2 data-parallel ranks.*allow_uneven"):
        split_batch({"x": np.arange(5)}, 2)
    shards = split_batch({"x": np.arange(5)}, 2, allow_uneven=True)
    assert [shard["x"].tolist() for shard in shards] == [[0, 1, 2], [3, 4]]
    assert shard_bounds(7, 3, allow_uneven=True) == [(0, 3), (3, 5), (5, 7)]


def test_fewer_rows_than_ranks_is_an_error_even_when_uneven_is_allowed():
    with pytest.raises(ValueError, match="2 rows cannot feed 3 data-parallel ranks"):
        split_batch({"x": np.arange(2)}, 3, allow_uneven=True)


def test_fields_that_disagree_on_batch_size_are_named():
    with pytest.raises(ValueError, match=r"input_ids: 4, mask: 3"):
        batch_size({"input_ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="no tensor, array or list"):
        batch_size({"step": 1})
    with pytest.raises(TypeError, match="dict or a dataclass"):
        batch_size(torch.zeros(4))


def test_dataclass_split_keeps_type_replicated_fields_and_skips_post_init():
    batch = _rollouts(4)
    shards = split_batch(batch, 2)
    assert all(type(shard) is Rollouts for shard in shards)
    assert shards[1].tokens.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert shards[1].rewards.tolist() == pytest.approx([0.2, 0.3])
    assert shards[1].texts == ["t2", "t3"]
    assert shards[0].bias is batch.bias and shards[1].temperature == 0.7


def test_nested_containers_are_split_recursively():
    shards = split_batch({"inputs": {"ids": torch.arange(4)}, "labels": torch.arange(4) * 10}, 2)
    assert shards[1]["inputs"]["ids"].tolist() == [2, 3]
    assert shards[1]["labels"].tolist() == [20, 30]


def test_merge_inverts_split():
    batch = _rollouts(5)
    merged = merge_shards(split_batch(batch, 2, allow_uneven=True))
    assert torch.equal(merged.tokens, batch.tokens)
    np.testing.assert_array_equal(merged.rewards, batch.rewards)
    assert merged.texts == batch.texts and merged.temperature == 0.7 and merged.bias is batch.bias


def test_merge_of_non_array_leaves_keeps_equal_values_and_lists_different_ones():
    merged = merge_shards([{"n": 2, "mode": "eval", "loss": torch.tensor(1.0)}, {"n": 3, "mode": "eval",
                                                                                 "loss": torch.tensor(1.0)}])
    assert merged["n"] == [2, 3] and merged["mode"] == "eval" and float(merged["loss"]) == 1.0
    assert merge_shards([None, None]) is None
    assert merge_shards([torch.ones(2), torch.zeros(1)]).tolist() == [1.0, 1.0, 0.0]


def test_merge_rejects_mixed_result_types_and_missing_keys():
    with pytest.raises(TypeError, match="different types"):
        merge_shards([{"a": np.ones(1)}, _rollouts(1)])
    with pytest.raises(KeyError, match="'b' is missing"):
        merge_shards([{"a": np.ones(1), "b": np.ones(1)}, {"a": np.ones(1)}])
