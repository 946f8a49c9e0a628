"""One rank's Megatron model of any parallel layout, built on the meta device in this one process: the independent
reference for `mrl plan`'s parameter arithmetic (tests/unit/app/test_app_plan_memory.py).

torch.distributed's fake process group (torch.testing._internal.distributed.fake_pg: every collective a no-op) lets
megatron-core's `initialize_model_parallel` lay out a world of any size with this process as any rank, and the meta
device builds a 671B model without memory; megatron-core then decides, as on a cluster, which layers, experts and
tensor shards the rank holds (mrl.parallel.groups.init_fake_process_groups makes the groups).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping


@contextmanager
def meta_rank_model(
    hf_config: Mapping[str, Any],
    *,
    world: int,
    rank: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> Iterator[Any]:
    """Rank `rank`'s model of a `world`-rank layout (sequence parallel whenever TP > 1, as mrl's MoE recipes)."""
    import torch

    from mrl.model.build import build_model, transformer_config_from_hf
    from mrl.parallel.groups import destroy_process_groups, init_fake_process_groups

    init_fake_process_groups(world, rank, tp=tp, pp=pp, ep=ep)
    try:
        uneven: dict[str, Any] = {  # TransformerConfig overrides, set only when given
            k: v
            for k, v in (
                ("num_layers_in_first_pipeline_stage", first_stage_layers),
                ("num_layers_in_last_pipeline_stage", last_stage_layers),
            )
            if v is not None
        }
        config = transformer_config_from_hf(
            dict(hf_config),
            tensor_parallel=tp,
            pipeline_parallel=pp,
            sequence_parallel=tp > 1,
            perform_initialization=False,
            expert_model_parallel_size=ep,
            **uneven,
        )
        with torch.device("meta"):
            yield build_model(dict(hf_config), config)
    finally:
        destroy_process_groups()
