"""The policy driven through Ray and a vLLM engine beside it, as the policy-group tests build them
(tests/functional/policy/test_policy_group.py, test_policy_moe_refit.py), and their HF transformers reference."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from mrl.distributed import RayCluster
    from mrl.distributed.cluster import Placement
    from mrl.inference.vllm_worker import VllmEngineGroup
    from mrl.policy.group import Policy
    from mrl.policy.interface import RankBatch


def hf_logprobs(
    model_dir: str | Path, ids: torch.Tensor, state: Optional[dict[str, torch.Tensor]] = None
) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) [B, T] under HF transformers in fp32 (0 at t = 0), with the model's own
    weights or `state` loaded over them (an export, which leaves out a tied lm_head)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        logits = model(ids).logits.float()
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return out


def grpo_batch(n: int = 8, t: int = 12, vocab: int = 200) -> "RankBatch":
    """n random sequences of t tokens, loss on tokens 4.., one random advantage per sequence."""
    from mrl.policy.interface import RankBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    mask[:, 4:] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return RankBatch(ids, mask, token_data={"advantages": adv})


def policy_group(
    cluster: "RayCluster", model_dir: str | Path, name: str, packing: bool = False, **parallel: Any
) -> tuple["Policy", "Placement"]:
    """A 2-rank fp32 policy (with its reference) on a placement of 2 bundles of its own, at the given parallel sizes."""
    from mrl.config.schema import OptimizerConfig, PackingConfig, ParallelConfig, PolicyConfig
    from mrl.policy.group import Policy
    from mrl.policy.worker import PolicySpec

    cfg = PolicyConfig(
        precision="float32",
        parallel=ParallelConfig(**parallel),
        train_micro_batch_size=2,
        logprob_micro_batch_size=4,
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        sequence_packing=PackingConfig(enabled=packing, tokens_per_microbatch=32),
    )
    placement = cluster.create_placement(name, bundles_per_node=2, cpus_per_bundle=1)
    spec = PolicySpec(hf_dir=str(model_dir), policy=cfg, seed=1, total_steps=10, with_reference=True)
    return Policy(spec, placement, world_size=2, resource_fraction=0.5), placement


def vllm_engine(
    model_dir: str | Path, placement: "Placement", bundle: int = 0, name: str = "generation-refit"
) -> "VllmEngineGroup":
    """One vLLM engine on bundle `bundle` of the policy's placement (half of it), refitted through shared-memory
    files."""
    from mrl.inference.vllm_backend import VllmEngineConfig
    from mrl.inference.vllm_worker import VllmEngineGroup

    config = VllmEngineConfig(
        model_path=str(model_dir), max_model_len=64, kv_cache_bytes=64 << 20, refit_transport="shm_file"
    )
    return VllmEngineGroup(config, placement, bundle_indices=[bundle], resource_fraction=0.5, name=name)
