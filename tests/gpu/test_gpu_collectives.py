"""mrl's collectives in a one-rank NCCL world (one GPU, in this process): NCCL refuses a host tensor outright, and
every collective mrl issues with one goes through mrl/parallel/collectives.py, which carries it on the GPU: the
tensor broadcast (header and data) over the pipeline group, the exporter's pipeline layout gather, the expert-load
reduce of a train step. A group of one runs those collectives too (collectives.py's docstring), so one GPU catches
a host tensor sent to NCCL. The export of an fp32 policy equals its HF weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from mrl.testing.tiny_models import build_tiny_hf_model

REFUSAL = "No backend type associated with device type cpu"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("gpu-collectives"), "qwen3_moe", hidden=64, layers=2,
                                   heads=4, intermediate=128))


@pytest.fixture
def world_of_one(monkeypatch):
    """The environment of a lone rank (PolicyWorker reads WORLD_SIZE); the groups go when the test ends."""
    from mrl.parallel.groups import destroy_process_groups

    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # a private rendezvous on a free port (groups.py)
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield
    destroy_process_groups()


def collectives_over_the_pipeline_group() -> dict:
    """Host and device tensors through collectives over Megatron's pipeline group; the direct host call refused."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mrl.parallel import collectives
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims())
    group = ps.get_pipeline_model_parallel_group()
    try:
        dist.all_reduce(torch.ones(2), group=group)  # what export.py and expert_load.py did before collectives.py
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    worst, on_device = torch.tensor([0.5, 2.0]), torch.arange(6.0, device=collectives.group_device(group)).view(2, 3)
    collectives.all_reduce(worst, op="max", group=group)
    sent = [collectives.broadcast_tensor(t, 0, group) for t in (torch.arange(4).view(2, 2), on_device)]
    (layout,) = collectives.all_gather(torch.tensor([0, 2]), group)
    collectives.barrier()
    return {"backend": dist.get_backend(), "device": collectives.group_device(group), "refused": refused,
            "worst": worst, "sent": sent, "layout": layout}


def export_and_expert_load(model_dir: str) -> dict:
    """An fp32 MoE PolicyWorker: its whole export (the exporter's pipeline gather included), then one train step
    (its expert-load reduce) and the export again."""
    from converters.hf_io import load_hf_state
    from mrl.config.schema import OptimizerConfig, PolicyConfig
    from mrl.objectives.loss import NLLLoss
    from mrl.policy.interface import RankBatch
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision="float32", train_micro_batch_size=4, train_global_batch_size=4,
                       logprob_micro_batch_size=4, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=1))
    exported = worker.export_state()
    ids = torch.randint(2, worker.model_dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 16)
    metrics = worker.train(RankBatch(ids, mask), NLLLoss(), float(mask[:, 1:].sum()))
    return {"hf": load_hf_state(model_dir), "exported": exported, "metrics": metrics,
            "after_step": worker.export_state(), "device": str(next(worker.module.parameters()).device)}


def test_nccl_refuses_host_tensors_and_collectives_carry_them(world_of_one):
    seen = collectives_over_the_pipeline_group()
    assert seen["backend"] == "nccl" and seen["device"] == torch.device("cuda", torch.cuda.current_device())
    assert REFUSAL in seen["refused"]
    assert seen["worst"].device.type == "cpu" and seen["worst"].tolist() == [0.5, 2.0]
    assert torch.equal(seen["sent"][0], torch.arange(4).view(2, 2)) and seen["sent"][0].device.type == "cpu"
    assert torch.equal(seen["sent"][1].cpu(), torch.arange(6.0).view(2, 3)) and seen["sent"][1].is_cuda
    assert seen["layout"].tolist() == [0, 2] and seen["layout"].device.type == "cpu"


def test_export_and_expert_load_run_over_nccl(world_of_one, moe_dir, figure):
    seen = export_and_expert_load(moe_dir)
    assert seen["device"].startswith("cuda")
    assert sorted(seen["exported"]) == sorted(seen["hf"])
    differing = [name for name, tensor in seen["exported"].items()
                 if not (tensor.dtype == torch.float32 and torch.equal(tensor.cpu(), seen["hf"][name]))]
    assert not differing, f"exported tensors differ from the HF weights: {differing}"
    assert seen["metrics"]["expert_load_max_over_mean"] >= 1.0  # reduced over the step's groups, on the GPU
    assert any(not torch.equal(seen["after_step"][n].cpu(), t) for n, t in seen["hf"].items())  # the step moved it
    figure("collectives.expert_load_max_over_mean", seen["metrics"]["expert_load_max_over_mean"], "ratio",
           tensors_exported_bit_exact=len(seen["exported"]))

