"""Each pipeline stage's first rank sends its own layers (the collective refit transport with one sender per stage,
docs/weight-transfer.md): a PP2 policy (two gloo ranks running `PolicyWorker` as the Ray actors do) exports into a
broadcast group whose receiver -- a thread of this process standing in for the engine, a member of both stages'
sub-groups -- ends with the HF checkpoint bit for bit. Each bucket comes from its owner stage's first rank and not a
byte crosses the pipeline group, while the rank-0 export (HF export; shared-memory and CUDA IPC refits) still
broadcasts stage 1's layers to rank 0 over it."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

BUCKET_BYTES = 60_000  # several buckets per stage (a layer of the tiny qwen2 is ~160 KB: cut between parameters)
REFITS = 2  # the second one on the header chain of the first (one broadcast per bucket)


# ---- rank side: imported by each rank process of run_on_ranks ----
def export_by_stage(model_dir: str, transport, bucket_bytes: int, refits: int) -> dict:
    """Every rank: the PP2 policy rank, `refits` exports into `transport` (one sender per stage), then the rank-0
    export of the whole state; the bytes broadcast over the pipeline group during each."""
    from mrl.config.schema import ParallelConfig, PolicyConfig
    from mrl.parallel import collectives
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision="float32", parallel=ParallelConfig(pipeline_parallel_size=2))
    worker = PolicyWorker(PolicySpec(hf_dir=model_dir, policy=cfg, seed=1, total_steps=1, trainable=False))
    pp_group = worker.ps.get_pipeline_model_parallel_group()
    moved = [0]
    real_broadcast = collectives.broadcast

    def counting(tensor, group_src, group=None):
        if group is pp_group:
            moved[0] += tensor.numel() * tensor.element_size()
        return real_broadcast(tensor, group_src, group)

    collectives.broadcast = counting  # broadcast_tensor (the exporter's pipeline broadcast) goes through it
    buckets = worker.plan_export(bucket_bytes)
    owners = worker.bucket_owners()
    worker.join_refit_group(transport)
    payloads = [[worker.export_bucket(index, transport) for index in range(buckets)] for _ in range(refits)]
    local_bytes, moved[0] = moved[0], 0
    state = worker.export_state()
    return {"stage": worker.refit_stage(), "owners": owners,
            "payloads": payloads, "local_pp_bytes": local_bytes, "rank0_pp_bytes": moved[0], "state": state}


def _owners(model_dir) -> list[int]:
    """Each bucket's owner stage, planned from the config alone (what every rank plans too)."""
    from converters import model_dims
    from converters.hf_io import load_hf_config
    from mrl.policy.export import StageInfo, bucket_stage, plan_buckets

    dims = model_dims(load_hf_config(str(model_dir)))
    stages = StageInfo((0, 1), (1, 1))  # 2 layers over 2 stages
    return [bucket_stage(b, stages) for b in plan_buckets(dims, "local", BUCKET_BYTES, 4, split_units=True,
                                                          stages=stages)]


def _receive(transport, owners: list[int], refits: int, out: list, errors: list) -> None:
    """The engine's side: join every sender's sub-group (as member 1), take each bucket from its owner's."""
    from mrl.inference.transports import collective

    try:
        transport.join(1, timeout_s=120)
        for _ in range(refits):
            state = {}
            for owner in owners:
                for name, tensor in collective.receive_bucket(collective.sub_group(transport.group, owner)):
                    state[name] = tensor.clone()  # views of the slot buffer: valid until the bucket after next
            out.append(state)
    except BaseException as error:  # noqa: BLE001 -- reported by the test
        errors.append(error)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("stages"), "qwen2", seed=5)


def test_pipeline_stages_send_their_own_layers(model_dir):
    from converters.hf_io import load_hf_state
    from mrl.distributed.env import find_free_port
    from mrl.inference.transports import collective

    name = f"stages-{uuid.uuid4().hex[:8]}"
    transport = collective.CollectiveTransport(name, "127.0.0.1", find_free_port(), 2,
                                               stages=(("127.0.0.1", find_free_port()),))
    owners = _owners(model_dir)
    assert owners[0] == 0 and owners[-1] == 1 and owners == sorted(owners)  # stage 0's buckets, then stage 1's
    received: list = []
    errors: list = []
    receiver = threading.Thread(target=_receive, args=(transport, owners, REFITS, received, errors), daemon=True)
    receiver.start()
    try:
        ranks = run_on_ranks(export_by_stage, 2, args=(str(model_dir), transport, BUCKET_BYTES, REFITS))
        receiver.join(timeout=60)
    finally:
        for sender in range(transport.senders):
            collective.leave_group(collective.sub_group(name, sender))
    assert not errors and not receiver.is_alive(), errors
    expected = load_hf_state(model_dir)
    assert [r["stage"] for r in ranks] == [0, 1]  # each rank is its stage's first rank
    assert all(r["owners"] == owners for r in ranks)
    # (a) each bucket's payload comes from its owner stage's first rank, named for that stage's sub-group
    for refit in range(REFITS):
        for index, owner in enumerate(owners):
            sent = [rank for rank, r in enumerate(ranks) if r["payloads"][refit][index] is not None]
            assert sent == [owner], (refit, index)
            payload = ranks[owner]["payloads"][refit][index]
            assert payload["group"] == collective.sub_group(name, owner)
    stage1 = {n for r in ranks for p in r["payloads"][0] if p is not None and p["group"] != name for n in p["names"]}
    assert "lm_head.weight" in stage1 and any(n.startswith("model.layers.1.") for n in stage1)
    assert not any(n.startswith("model.layers.0.") or n == "model.embed_tokens.weight" for n in stage1)
    # (b) the receiver ends with the checkpoint, bit for bit, in every refit
    assert len(received) == REFITS
    for state in received:
        assert sorted(state) == sorted(expected)
        assert all(state[n].dtype == expected[n].dtype and torch.equal(state[n], expected[n]) for n in expected)
    # (c) nothing crossed the pipeline group; the rank-0 export still broadcasts stage 1's layers to rank 0 over it
    assert [r["local_pp_bytes"] for r in ranks] == [0, 0]
    stage1_bytes = sum(expected[n].numel() * expected[n].element_size() for n in stage1)
    assert ranks[0]["rank0_pp_bytes"] >= stage1_bytes
    assert ranks[1]["state"] is None and sorted(ranks[0]["state"]) == sorted(expected)
    assert all(torch.equal(ranks[0]["state"][n], expected[n]) for n in expected)
