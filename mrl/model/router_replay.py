"""Router replay ("R3"): the trainer routes each token to the experts the engine chose when it sampled it, and the
per-layer measure of where engine and trainer route apart.

Data flow:

    engine (vLLM's routed-experts output, [T, layers, k] per sample)
      -> RankBatch.routing [N, T, layers, k] in `routing_dtype` (uint8 up to 255 experts, else int16), aligned with
         input_ids (NOT shifted: the router at position t sees token t), `no_route` where the engine reported nothing
         (padding, a sequence's last token, prompt tokens an engine did not return)
      -> train_step: cut like input_ids (context-parallel chunks, packs), then per model chunk `begin(chunk, routing)`
      -> `RoutingReplay` cuts the micro-batch to the tokens each router sees and hands every router its rows
      -> megatron-core's top-k (`moe_utils.topk_routing_with_score_function`) asks `router.router_replay
         .get_replay_topk(scores, topk, num_groups, group_topk, default)` (the hook of megatron-core 0.19.2's
         `transformer/moe/router_replay.py`, which mrl fills with its own object below)

Sharding contract at the hook: a router's input is this rank's hidden states [s, b, h] flattened s-major, so its
token rows are the micro-batch's [b, s] tokens transposed; under sequence parallelism s is this TP rank's contiguous
1/TP of the sequence (megatron's scatter to the sequence-parallel region); under context parallelism and packing the
train step has already cut the tokens as it cuts input_ids. Routers run before the expert-parallel dispatch, so EP
changes nothing here. The layer is the router's transformer layer (HF's index, `mrl.model.hybrid.gpt_layer_index` of
its global `layer_number`), the index vLLM's capturer uses
(`num_hidden_layers` rows per token; dense layers' rows are never read).

Tokens the engine reported nothing for (`no_route`, -1 once decoded by `routing_targets`) are routed freshly by the
trainer: the prompt is replayed where the engine returned it (vLLM returns the prompt's routing unless
`routed_experts_prompt_start` skips it), and a sequence's last token, which the engine never fed through the model,
has no routing to replay.

Recomputation (activation checkpointing) runs a layer's forward again inside the backward; the schedules run the
backwards of the micro-batches in the order of their forwards, so each router keeps a queue of the targets of the
forwards whose recompute is still to come.

Measurement (with or without replay): for every token with an engine routing, whether the trainer's own top-k set
(what it would route to) differs from the engine's, counted per layer on the first forward of each micro-batch
while `counting` (the policy worker counts in its first pass after a refit: the weights the engine sampled with).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch

from mrl.model.hybrid import gpt_layer_index


def routing_dtype(num_experts: int) -> torch.dtype:
    """The dtype a sample's routing is kept in: the smallest that holds the model's expert ids and a "none" mark
    (`no_route`) apart from them. uint8 up to 255 routed experts (Qwen3-30B-A3B's 128: one byte per token, layer and
    choice; 3.2 GB of int16 for 512 samples x 8K tokens x 48 layers x 8 become 1.6), int16 up to 32,767 (DeepSeek-V3's
    256: vLLM's uint8 ids use all 256 values, so none is left for the mark)."""
    if not 0 < num_experts <= torch.iinfo(torch.int16).max:
        raise ValueError(f"{num_experts} routed experts: router replay keeps expert ids below 32,768")
    return torch.uint8 if num_experts < 256 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The mark of a token without an engine routing (padding, a response's last token, a row without routing): 255 in
    uint8, -1 in int16; `routing_targets` turns it into -1."""
    return torch.iinfo(dtype).max if not dtype.is_signed else -1


def routing_targets(routing: torch.Tensor) -> torch.Tensor:
    """Stored routing (`routing_dtype`, marks `no_route`) as int64 expert ids with -1 where there is none: what the
    policy's routers replay."""
    targets = routing.long()
    if not routing.dtype.is_signed:
        targets[routing == no_route(routing.dtype)] = -1
    return targets


class _LayerReplay:
    """One router's replay state; megatron-core calls `get_replay_topk` in place of its top-k."""

    def __init__(self, layer: int, owner: "RoutingReplay") -> None:
        self.layer = layer
        self.owner = owner
        self.current: Optional[torch.Tensor] = None  # [n, k] long, this forward's targets (-1: route freshly)
        self.recompute_queue: deque[Optional[torch.Tensor]] = deque()  # None: that recompute routes freshly

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        default_compute_topk: Optional[Callable] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None  # megatron-core's topk always passes its own _compute_topk
        probs, fresh = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.owner.recompute and torch.is_grad_enabled() and self.owner.training
        target = self.recompute_queue.popleft() if recomputing else self.current
        if not recomputing and self.owner.record is not None:
            self.owner.record.setdefault(self.layer, []).append(fresh.detach().clone())
        if target is None:
            return probs, fresh
        if target.shape != fresh.shape:
            raise ValueError(
                f"router replay: layer {self.layer} sees {tuple(fresh.shape)} token choices, the batch's "
                f"routing gives {tuple(target.shape)}: the routing was cut for another layout"
            )
        known = (target >= 0).all(dim=-1)
        if not recomputing and self.owner.counting:
            self.owner.count(self.layer, fresh, target, known)
        if not self.owner.replay:
            return probs, fresh
        chosen = torch.where(known[:, None], target.to(fresh.device), fresh)
        return scores.gather(1, chosen), chosen


class RoutingReplay:
    """Installed on the routers of a policy's model chunks; fed each micro-batch's routing by the train step.

    replay:    route to the engine's experts (True) or only measure the disagreement (False)
    recompute: activation checkpointing is on (recomputed forwards take their targets from the queue)
    """

    def __init__(
        self,
        chunks: list[Any],
        *,
        replay: bool,
        recompute: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.replay, self.recompute = replay, recompute
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.training = False
        self.counting = True  # count disagreements (the policy worker counts in one pass per refit)
        self.record: Optional[dict[int, list[torch.Tensor]]] = None  # layer -> fresh top-k per forward (an engine)
        self.routers: dict[int, list[_LayerReplay]] = {}
        for chunk in chunks:
            states = []
            for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
                if router.config.moe_router_fusion:
                    raise ValueError(
                        "router replay needs megatron's unfused top-k (moe_router_fusion=False): the "
                        "fused kernel does not consult the replay hook"
                    )
                router.router_replay = _LayerReplay(gpt_layer_index(router.layer_number), self)
                states.append(router.router_replay)
            self.routers[id(chunk)] = states
        self.differs: dict[int, torch.Tensor] = {}  # on the routers' device: no host sync per layer and forward
        self.known: dict[int, torch.Tensor] = {}

    def router_rows(self, routing: torch.Tensor) -> torch.Tensor:
        """[b, s, L, k] routing of a micro-batch (this CP rank's tokens) -> [n, L, k], the rows its routers see."""
        rows = routing.transpose(0, 1)  # [s, b, L, k]: megatron's activations are sequence-first
        if self.sequence_parallel and self.tp_size > 1:
            rows = rows.chunk(self.tp_size, dim=0)[self.tp_rank]
        return rows.reshape(-1, *routing.shape[2:])

    def begin(self, chunk: Any, routing: Optional[torch.Tensor], *, training: bool) -> None:
        """Targets of the next forward of `chunk` (routing [b, s, L, k], or None: route freshly)."""
        self.training = training
        rows = None if routing is None else routing_targets(self.router_rows(routing))
        for state in self.routers.get(id(chunk), []):
            state.current = None if rows is None else rows[:, state.layer]
            if self.recompute and training:  # None too: its recompute routes freshly
                state.recompute_queue.append(state.current)

    def count(self, layer: int, fresh: torch.Tensor, target: torch.Tensor, known: torch.Tensor) -> None:
        """Tokens of `layer` whose fresh top-k set is not the engine's, among those with an engine routing."""
        differs = (fresh.sort(dim=-1).values != target.to(fresh.device).sort(dim=-1).values).any(dim=-1) & known
        self.differs[layer] = self.differs.get(layer, 0) + differs.sum()
        self.known[layer] = self.known.get(layer, 0) + known.sum()

    def reset(self) -> None:
        self.differs, self.known = {}, {}
        for states in self.routers.values():
            for state in states:
                state.current = None
                state.recompute_queue.clear()

    def counts(self, num_layers: int) -> torch.Tensor:
        """[2, num_layers] float64: tokens whose routing differs, tokens with an engine routing (0 where this rank
        holds no router of the layer: the pipeline stages' vectors add up)."""
        out = torch.zeros(2, num_layers, dtype=torch.float64)
        for layer in self.known:
            out[0, layer], out[1, layer] = float(self.differs[layer]), float(self.known[layer])
        return out


def disagreement_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Per MoE layer (every layer where a token carried an engine routing), the fraction of tokens whose top-k
    expert set the trainer chooses differently from the engine: `moe_routing_differs/layer_{i}`, and their maximum
    `moe_routing_differs_max` ({} when no token carried an engine routing). counts: [2, layers] (`counts`)."""
    layers = [i for i in range(counts.shape[1]) if counts[1, i] > 0]
    if not layers:
        return {}
    out = {f"moe_routing_differs/layer_{i}": float(counts[0, i] / counts[1, i]) for i in layers}
    out["moe_routing_differs_max"] = max(out.values())
    return out
