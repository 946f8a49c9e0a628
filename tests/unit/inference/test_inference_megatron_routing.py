"""`mrl.inference.megatron_routing`: where each forward's routing lands, by hand. The routers' records are set here as
RoutingReplay would leave them; the dynamic context's bookkeeping is given as the tensors megatron-core 0.19.2 keeps
(the real engine's routing is checked against the trainer's in tests/functional/policy/test_policy_router_replay.py).
"""

from types import SimpleNamespace

import pytest
import torch

from mrl.inference.megatron_routing import RoutingRecorder, dynamic_token_rows

NONE = 255  # no_route of uint8 (8 experts)


def recorder(rows: int) -> RoutingRecorder:
    rec = RoutingRecorder(torch.nn.Linear(1, 1), layers=2, max_len=6, num_experts=8, topk=2)  # a model without routers
    rec.start(rows)
    return rec


def test_a_static_batch_forward_lands_at_every_row_s_positions():
    rec = recorder(rows=2)
    # positions 1 and 2 of both rows; router rows sequence-first: (1, row 0), (1, row 1), (2, row 0), (2, row 1)
    rec.replay.record = {1: [torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])]}
    rec.collect_batch(torch.tensor([1, 2]))
    assert rec.row(0, 3)[:, 1].tolist() == [[NONE, NONE], [0, 1], [4, 5]]
    assert rec.row(1, 3)[:, 1].tolist() == [[NONE, NONE], [2, 3], [6, 7]]
    assert (rec.row(0, 6)[:, 0] == NONE).all()  # layer 0 recorded nothing (a dense layer)
    assert rec.replay.record == {}  # the next forward starts afresh


def test_a_flat_forward_lands_at_each_token_s_row_and_position():
    rec = recorder(rows=2)
    # row 1's prompt (positions 0-2) beside row 0's decode token at position 4; two rows of padding after them
    top = torch.tensor([[0, 1], [1, 2], [2, 3], [5, 6], [7, 7], [7, 7]])
    rec.replay.record = {0: [top], 1: [top.flip(1)]}
    rec.collect_tokens(torch.tensor([1, 1, 1, 0]), torch.tensor([0, 1, 2, 4]))
    assert rec.row(1, 3)[:, 0].tolist() == [[0, 1], [1, 2], [2, 3]]
    assert rec.row(1, 3)[:, 1].tolist() == [[1, 0], [2, 1], [3, 2]]
    assert rec.row(0, 6)[:, 0].tolist() == [[NONE, NONE]] * 4 + [[5, 6], [NONE, NONE]]


def test_the_dynamic_context_names_each_token_s_request_and_position():
    context = SimpleNamespace(
        paused_request_count=0,
        active_token_count=4,
        token_to_request_idx=torch.tensor([0, 0, 0, 1, 9, 9], dtype=torch.int32),  # slots; 9: stale entries
        request_ids=torch.tensor([3, 1]),  # slot -> request id
        token_to_pos_ids=torch.tensor([0, 1, 2, 7, 9, 9]),
    )
    rows, positions = dynamic_token_rows(context)
    assert rows.tolist() == [3, 3, 3, 1] and positions.tolist() == [0, 1, 2, 7]
    context.paused_request_count = 1
    with pytest.raises(AssertionError, match="paused"):
        dynamic_token_rows(context)
