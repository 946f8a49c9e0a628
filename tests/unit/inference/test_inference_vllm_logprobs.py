"""Reading the sampled tokens' logprobs out of vLLM's completion containers (`vllm_backend._sampled_logprobs`)."""

import itertools

from vllm.logprobs import FlatLogprobs, Logprob

from mrl.inference.vllm_backend import _sampled_logprobs


def _flat(positions: list[list[tuple[int, float]]]) -> FlatLogprobs:
    """A FlatLogprobs filled the way vLLM's output processor fills it: (token, logprob) per rank, sampled first."""
    flat = FlatLogprobs()
    for entries in positions:
        ids, values = [t for t, _ in entries], [v for _, v in entries]
        flat.append_fast(ids, values, itertools.chain((1,), range(1, len(ids))), [None] * len(ids))
    return flat


def test_flat_lists_of_the_sampled_tokens_are_read_as_they_are():
    flat = _flat([[(4, -0.5)], [(9, -1.25)], [(4, -2.0)]])
    assert _sampled_logprobs(flat, [4, 9, 4]) == [-0.5, -1.25, -2.0]


def test_flat_lists_with_other_tokens_go_through_the_per_position_view():
    # logprobs=1: the sampled token and the top-1 token at each position; the sampled one is picked by its id.
    flat = _flat([[(4, -0.5), (7, -0.1)], [(9, -1.25), (9, -1.25)]])
    assert _sampled_logprobs(flat, [4, 9]) == [-0.5, -1.25]


def test_dict_per_position_is_read_by_token_id():
    per_position = [{4: Logprob(-0.5), 7: Logprob(-0.1)}, {9: Logprob(-1.25)}]
    assert _sampled_logprobs(per_position, [4, 9]) == [-0.5, -1.25]
