"""The in-process Megatron world of one rank that the model tests build in (the CPU patches applied)."""

import pytest

from mrl.cpu import megatron_patches
from mrl.parallel.groups import destroy_process_groups, init_process_groups
from mrl.parallel.layout import ParallelDims


@pytest.fixture(scope="module")
def megatron_world_of_one():
    megatron_patches.apply()
    init_process_groups(ParallelDims(), seed=1234)
    yield
    destroy_process_groups()
