"""ParallelDims: derived sizes and the layout rules Megatron enforces, with messages naming the fix."""

import dataclasses

import pytest

from mrl.parallel.groups import default_backend
from mrl.parallel.layout import ParallelDims, ParallelLayoutError, length_multiple, micro_batching_violations


@pytest.mark.parametrize(
    "dims, dp, expert_dp",
    [
        (ParallelDims(), 1, 1),
        (ParallelDims(tp=2, world_size=8), 4, 4),
        (ParallelDims(tp=2, pp=2, cp=2, world_size=16), 2, 4),
        (ParallelDims(tp=2, ep=4, world_size=8), 4, 1),
        (ParallelDims(cp=2, ep=2, world_size=2), 1, 1),  # experts may span context-parallel ranks
        (ParallelDims(tp=2, sequence_parallel=True, world_size=2), 1, 1),
    ],
)
def test_derived_sizes(dims, dp, expert_dp):
    assert (dims.dp, dims.expert_dp) == (dp, expert_dp)
    assert dims.tp * dims.pp * dims.cp * dims.dp == dims.world_size


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3, world_size=8), "not divisible by tp\\*pp\\*cp = 3"),
        (dict(tp=2, pp=2, cp=2, world_size=4), "not divisible by tp\\*pp\\*cp = 8"),
        (dict(tp=2, ep=4, world_size=12), "expert parallel size 4 must divide dp\\*cp = 6"),
        (dict(ep=4, world_size=2), "expert parallel size 4 must divide dp\\*cp = 2"),
        (dict(sequence_parallel=True, world_size=2), "sequence parallelism needs tensor parallelism"),
        (dict(tp=0), "tensor_parallel_size: must be a positive integer"),
        (dict(world_size=2.0), "world size must be a positive integer"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_fix(kwargs, message):
    with pytest.raises(ParallelLayoutError, match=message):
        ParallelDims(**kwargs)


def test_all_problems_are_reported_together():
    with pytest.raises(ParallelLayoutError) as info:
        ParallelDims(tp=3, sequence_parallel=False, pp=1, world_size=4, ep=1, cp=1)
    assert "world_size=4, tp=3" in str(info.value)
    with pytest.raises(ParallelLayoutError) as info:
        ParallelDims(tp=1, sequence_parallel=True, world_size=3, pp=2)
    assert "not divisible" in str(info.value) and "sequence parallelism" in str(info.value)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelDims().tp = 2  # type: ignore[misc]


def test_backend_follows_the_device():
    import torch

    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_length_multiple_is_tp_with_sequence_parallel_times_two_cp():
    assert length_multiple(2, 2, sequence_parallel=True) == 8  # each of 2*cp chunks splits over tp
    assert ParallelDims(tp=2, cp=2, sequence_parallel=True, world_size=4).length_multiple == 8
    assert ParallelDims(tp=2, cp=1, world_size=2).length_multiple == 1


@pytest.mark.parametrize(
    "packing, dynamic, budget, pp, key",
    [
        (True, True, 16, 1, "policy.dynamic_batching.enabled"),  # alternatives
        (False, True, 16, 2, "policy.dynamic_batching.enabled"),  # variable shapes cannot cross stages
        (True, False, 12, 2, "policy.sequence_packing.tokens_per_microbatch"),  # 12 is no multiple of 8
        (True, False, 16, 2, None),
        (True, False, 12, 1, None),  # without pipeline parallelism packs are not padded to the budget
    ],
)
def test_micro_batching_rules_name_the_key(packing, dynamic, budget, pp, key):
    problems = micro_batching_violations(packing=packing, dynamic_batching=dynamic, tokens_per_microbatch=budget,
                                         pp=pp, multiple=8)
    assert [p.key for p in problems] == ([key] if key else [])
