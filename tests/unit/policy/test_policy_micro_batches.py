"""Token-budget micro-batches of the policy step: sequence lengths, the THD pack layout under CP, the unpack index."""

import pytest
import torch

from mrl.data.packing import pack_sequences
from mrl.model.router_replay import no_route
from mrl.policy.interface import RankBatch
from mrl.policy.train_step import StepContext, _packed_micro_batch, _predicting_space, sequence_lengths


def test_lengths_default_to_the_last_loss_token_and_are_checked():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    batch = RankBatch(torch.ones(3, 5, dtype=torch.long), mask)
    assert sequence_lengths(batch).tolist() == [3, 1, 5]
    batch.lengths = torch.tensor([4, 2, 5])
    assert sequence_lengths(batch).tolist() == [4, 2, 5]
    batch.lengths = torch.tensor([2, 2, 5])
    with pytest.raises(ValueError, match="sequence 0: loss_mask marks tokens past its length 2"):
        sequence_lengths(batch)
    batch.lengths = torch.tensor([4, 2, 6])
    with pytest.raises(ValueError, match="1..5"):
        sequence_lengths(batch)


def make_pack(cp_rank: int, fixed_size: bool, routing: torch.dtype | None = None):
    # Two sequences: ids 10.. (length 3, rounded to 4) and 20.. (length 8); cp 2 -> multiples of 4.
    ids = torch.zeros(2, 8, dtype=torch.long)
    ids[0, :3] = torch.tensor([10, 11, 12])
    ids[1] = torch.arange(20, 28)
    mask = torch.zeros(2, 8)
    mask[0, 1:3] = 1
    mask[1, 2:8] = 1
    batch = RankBatch(ids, mask, token_data={"adv": mask * 2}, seq_data={"score": torch.tensor([1.0, 2.0])},
                      lengths=torch.tensor([3, 8]))
    if routing is not None:  # [2, 6, 1 layer, k = 1]: each token's expert is its id; seq 0 is reported for 2 tokens
        batch.routing = torch.full((2, 6, 1, 1), no_route(routing), dtype=routing)
        batch.routing[0, :2, 0, 0] = ids[0, :2]
        batch.routing[1, :, 0, 0] = ids[1, :6]
    plan = pack_sequences([3, 8], 16, multiple=4)  # one pack: [seq 1 (8), seq 0 (4)], 12 of 16 tokens
    ctx = StepContext(dp_size=1, cp_rank=cp_rank, cp_size=2, cp_group=None, is_last_stage=True)
    return _packed_micro_batch(_predicting_space(batch, 8), batch, plan, 0, ctx, fixed_size)


def test_pack_layout_under_context_parallelism_by_hand():
    # seq 1 (8 tokens) in chunks of 2: rank 0 holds positions 0,1,6,7; seq 0 (4 tokens) in chunks of 1: 0, 3
    data = make_pack(cp_rank=0, fixed_size=False)
    assert data["input_ids"].tolist() == [[20, 21, 26, 27, 10, 0]]
    assert data["position_ids"].tolist() == [[0, 1, 6, 7, 0, 3]]  # positions restart per sequence
    assert data["targets"].tolist() == [[21, 22, 27, 0, 11, 0]]  # next token within the sequence, never across
    params = data["packed_seq_params"]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12] and params.cu_seqlens_q.tolist() == [0, 8, 11]
    assert params.max_seqlen_q == 8
    # rows in pack order (seq 1, seq 0); loss mask in predicting positions: mask of token t+1 at position t
    assert data["unpack_index"].tolist() == [[0, 1, 2, 3], [4, 5, 0, 0]]
    assert data["unpack_valid"].tolist() == [[True] * 4, [True, True, False, False]]
    assert data["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert data["adv"].tolist() == [[0, 2, 2, 0], [2, 0, 0, 0]]
    assert data["score"].tolist() == [2.0, 1.0]
    assert data["seq_num_tokens"].tolist() == [6, 2]  # whole sequences, not this rank's share


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_routing_is_cut_and_packed_with_its_tokens(dtype):
    """Routing (narrower than the batch: right-padded with the dtype's mark) travels with its tokens into the pack,
    CP chunks included; unreported tokens, padding and the filler sequence carry the mark (routed freshly)."""
    none = no_route(dtype)
    data = make_pack(cp_rank=0, fixed_size=False, routing=dtype)  # input_ids [20, 21, 26, 27, 10, 0]
    assert data["routing"].dtype == dtype
    assert data["routing"][0, :, 0, 0].tolist() == [20, 21, none, none, 10, none]
    data = make_pack(cp_rank=1, fixed_size=True, routing=dtype)  # input_ids [22, 23, 24, 25, 11, 12, 0, 0]
    assert data["routing"][0, :, 0, 0].tolist() == [22, 23, 24, 25, 11, none, none, none]


def test_fixed_size_pack_ends_with_one_padding_sequence():
    data = make_pack(cp_rank=1, fixed_size=True)
    assert data["input_ids"].tolist() == [[22, 23, 24, 25, 11, 12, 0, 0]]  # 16 tokens / cp 2
    params = data["packed_seq_params"]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16] and params.cu_seqlens_q.tolist() == [0, 8, 11, 11]


def test_budget_options_that_cannot_work_name_the_fix():
    from types import SimpleNamespace

    from mrl.config.schema import DynamicBatchingConfig, PackingConfig
    from mrl.policy.train_step import plan_micro_batches

    batch = RankBatch(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8))
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=None, is_last_stage=True)
    pipelined = [SimpleNamespace(config=SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True,
                                                        pipeline_model_parallel_size=2))]
    packing, dynamic = PackingConfig(enabled=True, tokens_per_microbatch=15), DynamicBatchingConfig(enabled=True)
    with pytest.raises(ValueError, match="policy.dynamic_batching.enabled"):
        plan_micro_batches(batch, pipelined, ctx, packing=packing, dynamic_batching=dynamic)
    with pytest.raises(ValueError, match="use policy.sequence_packing"):
        plan_micro_batches(batch, pipelined, ctx, dynamic_batching=dynamic)
    with pytest.raises(ValueError, match="tokens_per_microbatch: .*given 15; allowed: a multiple of 2"):
        plan_micro_batches(batch, pipelined, ctx, packing=packing)
    assert plan_micro_batches(batch, pipelined, ctx) is None
    plan = plan_micro_batches(batch, pipelined, ctx, packing=PackingConfig(enabled=True, tokens_per_microbatch=16))
    assert plan.bins == [[0, 1]] and plan.budget == 16


def test_a_logprob_pass_packs_by_its_own_budget_where_one_is_set():
    """`logprob_tokens_per_microbatch`: the logprob pass's plan takes it (its errors name it); training keeps
    `tokens_per_microbatch`; unset, both passes take the training budget."""
    from types import SimpleNamespace

    from mrl.config.schema import DynamicBatchingConfig, PackingConfig
    from mrl.policy.train_step import plan_micro_batches

    lengths = torch.tensor([8, 7, 6, 5, 4, 3])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    batch = RankBatch(torch.ones(6, 8, dtype=torch.long), mask, lengths=lengths)
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=None, is_last_stage=True)
    one_rank = [SimpleNamespace(config=SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=False,
                                                       pipeline_model_parallel_size=1))]
    for section in (PackingConfig(enabled=True, tokens_per_microbatch=8, logprob_tokens_per_microbatch=16),
                    DynamicBatchingConfig(enabled=True, tokens_per_microbatch=8, logprob_tokens_per_microbatch=16)):
        key = "dynamic_batching" if isinstance(section, DynamicBatchingConfig) else "sequence_packing"
        kwargs = dict(packing=section) if key == "sequence_packing" else dict(dynamic_batching=section)
        train = plan_micro_batches(batch, one_rank, ctx, **kwargs)
        logprob = plan_micro_batches(batch, one_rank, ctx, logprob=True, **kwargs)
        assert (train.budget, logprob.budget) == (8, 16) and len(logprob.bins) < len(train.bins), key
        assert sorted(j for b in logprob.bins for j in b) == list(range(6))  # every sequence, once
        assert section.budget(logprob=True) == (f"policy.{key}.logprob_tokens_per_microbatch", 16)
        section.logprob_tokens_per_microbatch = None
        assert plan_micro_batches(batch, one_rank, ctx, logprob=True, **kwargs).bins == train.bins
    pipelined = [SimpleNamespace(config=SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True,
                                                        pipeline_model_parallel_size=2))]
    odd = PackingConfig(enabled=True, tokens_per_microbatch=16, logprob_tokens_per_microbatch=17)
    with pytest.raises(ValueError, match="logprob_tokens_per_microbatch: .*given 17; allowed: a multiple of 2"):
        plan_micro_batches(batch, pipelined, ctx, packing=odd, logprob=True)
    assert plan_micro_batches(batch, pipelined, ctx, packing=odd).budget == 16
    too_small = PackingConfig(enabled=True, tokens_per_microbatch=8, logprob_tokens_per_microbatch=6)
    with pytest.raises(ValueError, match="logprob_tokens_per_microbatch"):
        plan_micro_batches(batch, one_rank, ctx, packing=too_small, logprob=True)
