"""Rollout rows, pass@k and the GRPO training rows, against values worked out by hand."""

from __future__ import annotations

import json

import pytest
import torch

from mrl.algorithms.evaluate import response_mean_logprobs
from mrl.algorithms.grpo import training_rows
from mrl.algorithms.rollout import Rollouts, rows_from_output
from mrl.objectives.passk import pass_at_k
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput


def _output() -> GenerationOutput:
    samples = [
        GeneratedSample(0, 0, [7, 8], [3, 4, 0], [-0.5, -0.25, -1.0], FinishReason.STOP),
        GeneratedSample(0, 1, [7, 8], [5], [-2.0], FinishReason.LENGTH),
        GeneratedSample(1, 0, [9], [], None, FinishReason.ABORTED),
        GeneratedSample(1, 1, [9], [6, 6], [-0.1, -0.2], FinishReason.STOP),
    ]
    return GenerationOutput(samples, num_prompts=2, n=2)


def test_rows_put_responses_after_their_prompts_with_engine_logprobs_on_token_positions():
    ids, mask, gen = rows_from_output(_output(), pad_id=1)
    assert ids.tolist() == [[7, 8, 3, 4, 0], [7, 8, 5, 1, 1], [9, 1, 1, 1, 1], [9, 6, 6, 1, 1]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    expected = [[0, 0, -0.5, -0.25, -1.0], [0, 0, -2.0, 0, 0], [0] * 5, [0, -0.1, -0.2, 0, 0]]
    assert torch.equal(gen, torch.tensor(expected, dtype=torch.float32))


def test_each_sample_mean_logprob_is_over_its_response_tokens_only():
    _, mask, gen = rows_from_output(_output(), pad_id=1)
    expected = [(-0.5 - 0.25 - 1.0) / 3, -2.0, 0.0, (-0.1 - 0.2) / 2]  # the aborted sample has no token: 0.0
    assert response_mean_logprobs(gen, mask) == pytest.approx(expected)


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 2, 2, 1 - 1 / 6), (4, 3, 2, 1.0), (4, 4, 4, 1.0), (4, 1, 4, 1.0),
    (5, 2, 3, 1 - 0.1),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
])
def test_pass_at_k_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_training_rows_pad_to_data_parallel_size_with_masked_rows():
    ids, mask, gen = rows_from_output(_output(), pad_id=1)
    rollouts = Rollouts(ids, mask, gen, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([3, 1, 0, 2]),
                        torch.tensor([False, True, False, False]), lengths=torch.tensor([5, 3, 1, 3]))
    adv = torch.tensor([0.5, -0.5, 0.0, 2.0])
    keep = torch.tensor([True, True, False, True])  # the empty (rejected) sample is dropped
    batch = training_rows(rollouts, adv, keep, dp_size=2)
    assert len(batch) == 4  # 3 kept + 1 padding row
    assert batch.input_ids[:3].tolist() == ids[[0, 1, 3]].tolist()
    assert batch.loss_mask[3].sum() == 0 and batch.loss_mask[:3].sum() == mask.sum()
    assert batch.token_data["advantages"][:, 0].tolist() == [0.5, -0.5, 2.0, 0.5]
    assert torch.equal(batch.token_data["generation_logprobs"][:3], gen[[0, 1, 3]])
    assert batch.lengths.tolist() == [5, 3, 3, 5]


def test_routing_sits_on_the_tokens_positions_and_travels_to_the_training_rows():
    """A sample's routing covers the tokens the engine fed (prompt, then the response but its last token); the rows
    carry it on those positions in its dtype, the dtype's "none" mark elsewhere, and the training rows keep it per
    kept sample."""
    from mrl.inference.interface import routing_rows

    def routed(tokens: int, first: int) -> torch.Tensor:  # [tokens, 2 layers, k = 2], as a 128-expert engine keeps it
        return (first + torch.arange(tokens * 4)).view(tokens, 2, 2).to(torch.uint8)

    out = _output()
    out.samples[0] = GeneratedSample(0, 0, [7, 8], [3, 4, 0], [-0.5, -0.25, -1.0], FinishReason.STOP,
                                     routing=routed(4, 0))
    out.samples[3] = GeneratedSample(1, 1, [9], [6, 6], [-0.1, -0.2], FinishReason.STOP, routing=routed(2, 100))
    assert routing_rows([s.routing for s in _output().samples], 5) is None  # an engine that returned none
    rows = routing_rows([s.routing for s in out.samples], 5)
    assert rows.shape == (4, 5, 2, 2) and rows.dtype == torch.uint8
    assert torch.equal(rows[0, :4], routed(4, 0)) and (rows[0, 4] == 255).all()  # uint8's mark of "none"
    assert (rows[1] == 255).all() and (rows[2] == 255).all()
    assert torch.equal(rows[3, :2], routed(2, 100)) and (rows[3, 2:] == 255).all()
    ids, mask, gen = rows_from_output(out, pad_id=1)
    rollouts = Rollouts(ids, mask, gen, torch.zeros(4), torch.tensor([3, 1, 0, 2]), torch.zeros(4, dtype=torch.bool),
                        routing=rows)
    batch = training_rows(rollouts, torch.ones(4), torch.tensor([True, False, False, True]), dp_size=1)
    assert torch.equal(batch.routing, rows[[0, 3]])
    again = Rollouts.from_state_dict(rollouts.state_dict())  # checkpoints (async GRPO's queue, resume) keep it
    assert torch.equal(again.routing, rows)


def test_score_rows_read_routed_experts_and_refuse_malformed_ones(tmp_path):
    from mrl.algorithms.score import _read_rows
    from mrl.inference.interface import routing_rows

    lines = [{"input_ids": [5, 6, 7], "routed_experts": [[[1, 2]], [[3, 0]]]},  # 2 of 3 tokens, 1 layer, k = 2
             {"text": "hi", "routed_experts": [[[1, 2]]]},
             {"input_ids": [5, 6], "routed_experts": [[1, 2], [3, 4]]},
             {"input_ids": [5, 6], "routed_experts": [[[1, 2]], [[1, 2]], [[1, 2]]]},
             {"input_ids": [8, 9, 10, 11]}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = _read_rows(source, tokenizer=lambda text, **_: {"input_ids": [1, 2, 3]}, limit=100)
    assert rows[0].routing.tolist() == [[[1, 2]], [[3, 0]]] and rows[0].routing.dtype == torch.int16
    assert "input_ids" in rows[1].error and "[tokens][layers][k]" in rows[2].error and "at most" in rows[3].error
    batch = routing_rows([rows[0].routing, rows[4].routing], width=4)
    assert batch.shape == (2, 4, 1, 2)
    assert batch[0, :2].tolist() == [[[1, 2]], [[3, 0]]] and (batch[0, 2:] == -1).all() and (batch[1] == -1).all()
    assert routing_rows([rows[4].routing], width=4) is None
    with pytest.raises(ValueError, match="another model"):
        routing_rows([rows[0].routing, torch.zeros(1, 2, 2, dtype=torch.int16)], width=4)
    with pytest.raises(ValueError, match="another model"):  # the same shape kept in another dtype
        routing_rows([rows[0].routing, torch.zeros(1, 1, 2, dtype=torch.uint8)], width=4)
