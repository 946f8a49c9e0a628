"""Expert load of a mixture-of-experts policy during a train step: how evenly the routers spread the tokens.

Every router of this rank's model chunks is hooked; its forward returns the routing map [tokens, E] (True where a
token goes to an expert), whose column sums are added up per router over the step's micro-batches. At the end of
the step the counts are summed over the ranks that routed different tokens (data and context parallel, and tensor
parallel under sequence parallelism, where each TP rank routes its own part of the sequence) and reported as
    expert_load_max_over_mean = max over MoE layers of (max_e tokens_e / mean_e tokens_e)
1.0 is a perfectly even load; E (the number of experts) means every token of a layer went to one expert. Padding
tokens are routed like real ones and counted (packing removes most of them). Recomputed forwards (activation
checkpointing) count twice, which leaves the ratio unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mrl.parallel import collectives


class ExpertLoad:
    """Counts tokens per expert on this rank's routers (no-op for a dense model)."""

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[int, torch.Tensor] = {}
        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    def _hook(self, index: int):
        def count(module: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            routed = output[1].detach().sum(dim=0).to(torch.float64)  # [E] tokens per expert
            self.counts[index] = self.counts.get(index, 0) + routed

        return count

    def reset(self) -> None:
        self.counts = {}

    def report(self, sum_groups: list[Any], pipeline_group: Any) -> Optional[dict[str, float]]:
        """The step's metric (collective over `sum_groups` and the pipeline group; every rank must call it), then
        reset; None for a dense model."""
        if not self.handles:
            return None
        counts = torch.stack([self.counts[i] for i in sorted(self.counts)]) if self.counts else torch.zeros(0, 1)
        for group in sum_groups:  # reduced over groups of one too: once a step (collectives.py)
            collectives.all_reduce(counts, group=group)
        mean = counts.mean(dim=1).clamp(min=1e-12)
        worst = torch.tensor([float((counts.max(dim=1).values / mean).max()) if len(counts) else 0.0])
        collectives.all_reduce(worst, op="max", group=pipeline_group)  # stages hold different layers
        self.reset()
        return {"expert_load_max_over_mean": float(worst)}
