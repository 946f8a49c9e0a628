"""The experts the Megatron backend's routers chose for every token it fed (router replay, mrl/model/router_replay.py),
for either of its loops.

Data flow (one call, `rows` rows):
    start(rows) --> buffer [rows, max_model_len, MoE layers, k], `no_route` everywhere
    each forward: the routers' fresh top-k (RoutingReplay's record, one entry per MoE layer, its rows the forward's
      tokens in Megatron's sequence-first order) --> written at each token's (row, position):
        static loop: every row feeds the same positions [start, end) (`collect_batch`);
        dynamic loop: one flat sequence of every active request's new tokens; the dynamic context names each token's
          request and position (`collect_tokens`); the request ids are the rows' indices
    after the call: row r's routing = buffer[r, :fed], fed = prompt + response - 1 tokens (the last sampled token is
    never fed), the shape vLLM's routed-experts capture returns.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mrl.model.router_replay import RoutingReplay, no_route, routing_dtype


class RoutingRecorder:
    """Routed experts per row and position of one generation call, `routing_dtype`, `no_route` until fed."""

    def __init__(self, model: Any, layers: int, max_len: int, num_experts: int, topk: int) -> None:
        self.replay = RoutingReplay([model], replay=False, recompute=False)
        self.replay.record = {}
        self.layers, self.max_len, self.topk, self.dtype = layers, max_len, topk, routing_dtype(num_experts)
        self.buffer: Optional[torch.Tensor] = None

    def start(self, rows: int) -> None:
        self.buffer = torch.full((rows, self.max_len, self.layers, self.topk), no_route(self.dtype), dtype=self.dtype)
        self.replay.record = {}

    def row(self, index: int, fed: int) -> torch.Tensor:
        """Row `index`'s routing of its first `fed` tokens: [fed, layers, k]."""
        assert self.buffer is not None, "start() comes before the call's forwards"
        return self.buffer[index, :fed].clone()

    def collect_batch(self, positions: torch.Tensor) -> None:
        """A static batch's forward: every row fed `positions`; router rows are [position, row] flattened."""
        assert self.buffer is not None, "start() comes before the call's forwards"
        rows, positions = self.buffer.shape[0], positions.cpu()
        for layer, top in self._forward_top():
            self.buffer[:, positions, layer] = top.view(len(positions), rows, -1).transpose(0, 1)

    def collect_tokens(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """A flat forward of tokens (row `rows[i]`, position `positions[i]`); the router rows beyond them are the
        context's padding."""
        assert self.buffer is not None, "start() comes before the call's forwards"
        rows, positions = rows.long().cpu(), positions.long().cpu()
        for layer, top in self._forward_top():
            self.buffer[rows, positions, layer] = top[: len(rows)]

    def _forward_top(self) -> list[tuple[int, torch.Tensor]]:
        """(MoE layer, its routers' top-k in `dtype` on the CPU) of the one forward since the last collect."""
        record = self.replay.record
        assert record is not None
        chosen = []
        for layer, tops in record.items():
            (top,) = tops  # one forward since the last collect
            chosen.append((layer, top.to(self.dtype).cpu()))
        self.replay.record = {}
        return chosen


def dynamic_token_rows(context: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(request id, position) of each token of the dynamic context's current forward, megatron-core 0.19.2's
    bookkeeping: `token_to_request_idx` indexes the context's request slots (paused requests first: mrl's loop sizes
    its KV cache so that none is ever paused), `request_ids` holds each slot's id, `token_to_pos_ids` each token's
    position in its request."""
    assert context.paused_request_count == 0, "a paused request would shift the request slots"
    tokens = context.active_token_count
    slots = context.token_to_request_idx[:tokens].long()
    return context.request_ids[slots.to(context.request_ids.device)].cpu(), context.token_to_pos_ids[:tokens].cpu()
