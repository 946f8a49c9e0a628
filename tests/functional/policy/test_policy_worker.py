"""One policy rank in a process of its own: activation recomputation changes nothing but memory, neither does the
memory hand-over around generation (mrl/policy/memory.py), and the learning rate follows warm-up + cosine decay
exactly as computed by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model


# ---- rank side ----
def train_steps(model_dir: str, steps: int, recompute: bool, scheduler: dict, handover: bool = False,
                precision: str = "float32") -> dict:
    """`handover`: after every step, release the memory as before an engine wakes, with the CUDA mechanism made
    active on the host (parked storages are really resized to 0 bytes), and, after odd steps, a logprob pass
    (takes the weights back alone) and a second release; the next step takes everything back."""
    from mrl.objectives.loss import GRPOLoss
    from mrl.config.schema import OffloadConfig, OptimizerConfig, PolicyConfig, SchedulerConfig
    from mrl.policy.interface import RankBatch
    from mrl.policy.memory import HostOffload, optimizer_states
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision=precision, activation_checkpointing=recompute, train_micro_batch_size=4,
                       optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0), scheduler=SchedulerConfig(**scheduler))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=steps))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    mask[:, 5:] = 1
    batch = RankBatch(ids, mask, {"advantages": torch.randn(8, generator=g)[:, None].expand(8, 12).contiguous()})
    if handover:
        worker.memory = HostOffload(worker.model, worker.optimizer, OffloadConfig(weights=True), active=True)
    metrics, parked = [], []
    for step in range(steps):
        metrics.append(worker.train(batch, GRPOLoss(), float(mask[:, 1:].sum())))
        if handover:
            moved = worker.release_memory()
            held = [t.untyped_storage().nbytes() for t in [*worker.module.parameters(),
                                                            *optimizer_states(worker.optimizer)]]
            parked.append((moved, sum(held), worker.memory_released()))
            if step % 2:
                worker.logprobs(batch)
                worker.release_memory()
    params = list(worker.module.parameters())
    return {"loss": [m["loss"] for m in metrics], "lr": [m["lr"] for m in metrics],
            "grad_norm": [m["grad_norm"] for m in metrics], "logprobs": worker.logprobs(batch), "parked": parked,
            "released": worker.memory_released(), "params": sum(p.numel() for p in params),
            "bf16_params": sum(p.numel() for p in params if p.dtype == torch.bfloat16),
            "param_bytes": sum(p.numel() * p.element_size() for p in params)}


def handover_and_plain(model_dir: str) -> tuple[dict, dict]:
    """bf16 steps (fp32 main weights in Megatron's mixed-precision optimizer, as on GPUs) with and without the
    hand-over, by two workers built one after the other in this process (the second re-creates the groups)."""
    return tuple(train_steps(model_dir, 3, False, {"style": "constant"}, handover, "bfloat16")
                 for handover in (True, False))


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("worker"), seed=5))


def test_activation_recomputation_gives_the_same_steps(model_dir):
    schedule = {"style": "constant"}
    plain = run_on_ranks(train_steps, 1, args=(model_dir, 3, False, schedule))[0]
    recomputed = run_on_ranks(train_steps, 1, args=(model_dir, 3, True, schedule))[0]
    assert recomputed["loss"] == plain["loss"]
    assert torch.equal(recomputed["logprobs"], plain["logprobs"])


def test_memory_handover_between_steps_changes_nothing(model_dir):
    cycled, plain = run_on_ranks(handover_and_plain, 1, args=(model_dir,))[0]
    n, n_bf16 = cycled["params"], cycled["bf16_params"]
    for moved, held, released in cycled["parked"]:
        # Adam's two moments (8 B a parameter), fp32 main weights of the bf16 parameters (4 B; the norms are fp32
        # and their own main weights), the fp32 gradient buffer (4 B) and the weights go; every parked storage
        # holds 0 bytes.
        assert round(moved["optimizer_states_gb"] * 1e9) >= 8 * n + 4 * n_bf16
        assert round(moved["gradients_gb"] * 1e9) >= 4 * n
        assert round(moved["weights_gb"] * 1e9) == cycled["param_bytes"] and held == 0 and released
    assert cycled["released"]  # the logprob pass at the end took the weights alone back
    assert cycled["loss"] == plain["loss"] and cycled["grad_norm"] == plain["grad_norm"]
    assert torch.equal(cycled["logprobs"], plain["logprobs"])


def test_warmup_then_cosine_learning_rates(model_dir):
    got = run_on_ranks(train_steps, 1, args=(model_dir, 6, False, {"style": "cosine", "warmup_steps": 2}))[0]
    peak, warmup, decay = 1e-2, 2, 6  # decay_steps defaults to the run's 6 steps
    expected = []
    for done in range(6):  # step k uses the rate after k - 1 completed steps
        if done <= warmup:
            expected.append(peak * done / warmup)
        else:
            expected.append(0.5 * (math.cos(math.pi * (done - warmup) / (decay - warmup)) + 1) * peak)
    assert got["lr"] == pytest.approx(expected, abs=1e-12)


# ---- Megatron's overlap options (mrl/policy/speed.py), forced on where auto leaves them off (CPU) ----
def _half_batch_of_this_rank():
    """(this rank's half of an 8 x 12 GRPO batch, the whole batch's loss-token count) on one of two ranks."""
    from mrl.policy.interface import RankBatch

    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 200, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    mask[:, 5:] = 1
    adv = torch.randn(8, generator=g)[:, None].expand(8, 12).contiguous()
    rows = slice(4 * rank, 4 * rank + 4)
    return RankBatch(ids[rows], mask[rows], {"advantages": adv[rows]}), float(mask[:, 1:].sum())


def overlapped_steps(model_dir: str, overlap: bool, folder: str) -> dict:
    """Two data-parallel ranks with the distributed optimizer, 3 steps of 2 micro-batches each (the reduce runs
    from the last micro-batch's backward hooks), then the whole model exported straight after the last step (no
    forward in between: the overlapped gather must be completed by the export), and a save."""
    from mrl.config.schema import OptimizerConfig, PolicyConfig, SpeedConfig
    from mrl.objectives.loss import GRPOLoss
    from mrl.policy.worker import PolicySpec, PolicyWorker

    speed = SpeedConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    cfg = PolicyConfig(precision="float32", train_micro_batch_size=2, speed=speed,
                       optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=True))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=3))
    batch, count = _half_batch_of_this_rank()
    metrics = [worker.train(batch, GRPOLoss(), count) for _ in range(3)]
    state = worker.export_state()
    worker.save(folder)
    return {"speed": worker.speed, "metrics": metrics, "state": state,
            "no_sync": worker.tconfig.no_sync_func is not None}


def test_overlapped_reduce_and_gather_give_the_same_steps_and_weights(model_dir, tmp_path):
    plain = run_on_ranks(overlapped_steps, 2, args=(model_dir, False, str(tmp_path / "plain")))
    overlapped = run_on_ranks(overlapped_steps, 2, args=(model_dir, True, str(tmp_path / "overlapped")))
    assert overlapped[0]["speed"].overlap_grad_reduce and overlapped[0]["speed"].overlap_param_gather
    assert overlapped[0]["no_sync"] and not plain[0]["no_sync"]  # the schedule's hooks, as Megatron's trainer sets them
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in overlapped[0]["metrics"]] == [m[key] for m in plain[0]["metrics"]]
    reference, got = plain[0]["state"], overlapped[0]["state"]
    assert sorted(got) == sorted(reference)
    initial = load_file(str(Path(model_dir) / "model.safetensors"))
    changed = [name for name in reference if name in initial and not torch.equal(reference[name], initial[name])]
    assert changed  # the steps moved the weights, so the comparison below sees the gathered update
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


# ---- grouped expert GEMMs (policy.speed.grouped_expert_gemm), forced on where auto leaves them off (CPU) ----
def moe_steps(model_dir: str, grouped: bool) -> dict:
    """Two expert-parallel ranks of the tiny MoE model, 2 steps of 2 micro-batches each, then the whole model
    exported (lr 1e-3: Adam scales a gradient's rounding up to a step of the order of lr where the gradient is
    tiny, so the bound on the weights follows lr)."""
    from mrl.config.schema import OptimizerConfig, ParallelConfig, PolicyConfig, SpeedConfig
    from mrl.objectives.loss import GRPOLoss
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision="float32", train_micro_batch_size=2, speed=SpeedConfig(grouped_expert_gemm=grouped),
                       parallel=ParallelConfig(expert_parallel_size=2),
                       optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=2))
    batch, count = _half_batch_of_this_rank()
    metrics = [worker.train(batch, GRPOLoss(), count) for _ in range(2)]
    experts = {(type(m).__name__, getattr(m, "loop_reason", None)) for name, m in worker.module.named_modules()
               if name.endswith("mlp.experts")}
    return {"metrics": metrics, "state": worker.export_state(), "experts": experts,
            "logprobs": worker.logprobs(batch)}


def test_grouped_expert_gemms_give_the_same_steps_and_weights_under_ep2(tmp_path):
    model_dir = str(build_tiny_hf_model(tmp_path / "moe", "qwen3_moe", hidden=64, layers=2, intermediate=128))
    loop = run_on_ranks(moe_steps, 2, args=(model_dir, False))
    grouped = run_on_ranks(moe_steps, 2, args=(model_dir, True))
    assert loop[0]["experts"] == {("SequentialMLP", None)} and grouped[0]["experts"] == {("GroupedGemmExperts", None)}
    for rank in (0, 1):  # fp32 sums in another order (oneDNN's GEMMs against torch's grouped kernel)
        for key in ("loss", "grad_norm"):
            assert [m[key] for m in grouped[rank]["metrics"]] == pytest.approx(
                [m[key] for m in loop[rank]["metrics"]], rel=1e-5), key
        torch.testing.assert_close(grouped[rank]["logprobs"], loop[rank]["logprobs"], atol=1e-4, rtol=0)
    reference, got = loop[0]["state"], grouped[0]["state"]
    assert sorted(got) == sorted(reference) and any("experts" in name for name in reference)
    worst = max((got[name] - reference[name]).abs().max().item() for name in reference)
    assert worst <= 1e-4, worst  # measured 6.8e-6: Adam turns gradients' rounding into updates of up to ~lr
