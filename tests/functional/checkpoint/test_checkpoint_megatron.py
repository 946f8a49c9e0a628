"""Megatron checkpoints: a resumed run continues exactly like one that never stopped, under any layout.

Each scenario: a reference run trains steps 0-3 and saves after step 1 (two steps done) into a folder from
CheckpointManager.begin(2), committed by the test (the controller). Fresh processes, with a different random
init and seed (so every value must come from the checkpoint), load `manager.latest()` and train steps 2-3 on
the same batches. The LR schedule (warm-up + cosine over 4 steps) and Adam's bias correction depend on the
restored step counts; with dropout on, the per-rank RNG states must be restored too.
"""

from __future__ import annotations

import pytest
import torch

from mrl.checkpoint.manager import CheckpointManager
from mrl.testing.distributed import DistributedRunError, run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

TOTAL_STEPS = 4


# ---- rank side: imported by each rank process of run_on_ranks ----


class TokenPGLoss:
    """-(advantage * logprob) summed over valid tokens / the step's global token count."""

    level = "token"

    def __call__(self, logprobs, batch, count):
        loss = (-logprobs * batch["adv"] * batch["loss_mask"]).sum() / count
        return loss, {}


def make_batch(step: int, n: int = 8, t: int = 16, vocab: int = 200):
    g = torch.Generator().manual_seed(100 + step)  # another batch every step
    ids = torch.randint(2, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 2: 6 + i] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return ids, mask, adv


def run(model_dir: str, steps: list[int], *, tp: int = 1, dropout: float = 0.0, distributed_optimizer: bool = False,
        save_after: tuple[int, str] | None = None, load_from: str | None = None, load_optimizer: bool = True,
        precision: str = "float32") -> dict:
    """Train `steps` (batch i at step i); save after step `save_after[0]` into `save_after[1]`; or first resume
    from `load_from` (fresh random init, another seed). Returns losses, lrs, final weights (and the saved ones),
    the load report."""
    import json
    import multiprocessing
    import os
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from safetensors.torch import load_file

    from mrl.checkpoint.megatron import load_megatron_state, save_megatron_state
    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import destroy_process_groups, init_process_groups
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.policy.optim import build_optimizer, build_scheduler
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, train_on_batch

    init_process_groups(ParallelDims(tp=tp, world_size=int(os.environ["WORLD_SIZE"])),
                        seed=1234 if load_from is None else 4321)
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = getattr(torch, precision)
    cfg = transformer_config_from_hf(hf_config, tensor_parallel=tp, hidden_dropout=dropout, attention_dropout=dropout,
                                     params_dtype=dtype)
    model = build_model(hf_config, cfg)
    if load_from is None:
        load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")), hf_config)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=1e-3, weight_decay=0.01, use_distributed_optimizer=distributed_optimizer)
    optimizer = build_optimizer([ddp], opt_cfg, params_dtype=dtype)
    scheduler = build_scheduler(optimizer, opt_cfg, SchedulerConfig(style="cosine", warmup_steps=1),
                                total_steps=TOTAL_STEPS)
    report = None
    if load_from is not None:
        report = load_megatron_state(load_from, [ddp], optimizer, scheduler, load_optimizer=load_optimizer)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ctx = StepContext(dp_size=dp, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=hf_config["vocab_size"])
    losses, lrs, saved, left_running = [], [], None, None
    weights_now = lambda: {k: v.detach().clone() for k, v in model.state_dict().items()  # noqa: E731
                           if not k.endswith("_extra_state")}
    for step in steps:
        ids, mask, adv = make_batch(step)
        rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
        batch = RankBatch(ids[rows], mask[rows], token_data={"adv": adv[rows]})
        metrics = train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=TokenPGLoss(),
                                 count=global_count(mask, "token"), micro_batch_size=2, ctx=ctx)
        loss = torch.tensor(metrics["loss"], dtype=torch.float64)
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        losses.append(float(loss))
        lrs.append(metrics["lr"])
        if save_after is not None and step == save_after[0]:
            save_megatron_state(save_after[1], [ddp], optimizer, scheduler)
            saved = weights_now()
            left_running = [child.name for child in multiprocessing.active_children()]
    result = {"losses": losses, "lrs": lrs, "weights": weights_now(), "saved_weights": saved, "report": report,
              "processes_left_by_save": left_running,
              "optimizer_state_size": sum(len(inner.optimizer.state) for inner in optimizer.chained_optimizers),
              "lr_now": optimizer.param_groups[0]["lr"]}
    destroy_process_groups()
    return result


def export_to_hf(step_dir: str, hf_config_dir: str, out_dir: str) -> None:
    from mrl.app.convert import megatron_to_hf

    megatron_to_hf(step_dir, out_dir, hf_config_dir=hf_config_dir)


# ---- controller side (the test process) ----


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=2, seed=5))


def reference_with_checkpoint(root, model_dir: str, world_size: int, **layout) -> tuple[list, CheckpointManager]:
    """The uninterrupted run (steps 0-3) that checkpoints after step 1; the test commits like the controller."""
    manager = CheckpointManager(root, keep_last=2)
    tmp = manager.begin(2)
    results = run_on_ranks(run, world_size=world_size, args=(model_dir, [0, 1, 2, 3]),
                           kwargs=dict(save_after=(1, str(tmp)), **layout))
    manager.commit(2, tmp, {"loss": results[0]["losses"][1]})
    return results, manager


@pytest.fixture(scope="module")
def tp1_reference(model_dir, tmp_path_factory):
    return reference_with_checkpoint(tmp_path_factory.mktemp("ckpt_tp1"), model_dir, 1)


def assert_same_weights(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_resume_at_tp1_is_bit_identical(model_dir, tp1_reference):
    (reference,), manager = tp1_reference
    latest = manager.latest()
    assert latest is not None and latest.name == "step_2"
    assert sorted(p.name for p in latest.iterdir()) == ["COMPLETE", "model", "optimizer", "rng"]
    (resumed,) = run_on_ranks(run, world_size=1, args=(model_dir, [2, 3]), kwargs=dict(load_from=str(latest)))
    assert resumed["report"].optimizer_loaded and resumed["report"].rng_restored
    assert resumed["lrs"] == reference["lrs"][2:]
    assert resumed["losses"] == reference["losses"][2:]
    assert_same_weights(resumed["weights"], reference["weights"])


def test_resume_with_distributed_optimizer_at_dp2_is_bit_identical(model_dir, tmp_path):
    # dropout on: each rank's torch generator and Megatron's tracker must come back from the checkpoint
    layout = dict(distributed_optimizer=True, dropout=0.1)
    reference, manager = reference_with_checkpoint(tmp_path, model_dir, 2, **layout)
    resumed = run_on_ranks(run, world_size=2, args=(model_dir, [2, 3]),
                           kwargs=dict(load_from=str(manager.latest()), **layout))
    assert sorted(p.name for p in (manager.latest() / "rng").iterdir()) == ["layout.json", "rank_00000.pt",
                                                                        "rank_00001.pt"]
    for rank in range(2):
        assert resumed[rank]["report"].rng_restored
        assert resumed[rank]["losses"] == reference[rank]["losses"][2:]
        assert resumed[rank]["lrs"] == reference[rank]["lrs"][2:]
        assert_same_weights(resumed[rank]["weights"], reference[rank]["weights"])


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_resume_in_bf16_is_bit_identical(model_dir, tmp_path, distributed_optimizer):
    """bf16 weights with fp32 main weights in Megatron's mixed-precision optimizers (every GPU run): each saves and
    resumes exactly. Both failed to save while the local spec's norms stayed fp32 in a bf16 model (found on an H200:
    'Optimizer shape ((128,) does not match model shape ((384,))')."""
    layout = dict(distributed_optimizer=distributed_optimizer, precision="bfloat16")
    (reference,), manager = reference_with_checkpoint(tmp_path, model_dir, 1, **layout)
    (resumed,) = run_on_ranks(run, world_size=1, args=(model_dir, [2, 3]),
                              kwargs=dict(load_from=str(manager.latest()), **layout))
    assert resumed["report"].optimizer_loaded
    assert resumed["losses"] == reference["losses"][2:]
    assert_same_weights(resumed["weights"], reference["weights"])
    assert {v.dtype for v in resumed["weights"].values()} == {torch.bfloat16}


def test_a_save_starts_no_process_that_outlives_it(tp1_reference):
    """megatron-core's writer would start a multiprocessing Manager (a new interpreter, seconds) on a process's
    first save and keep it running; `save_sharded` gives it an in-process queue instead."""
    results, _ = tp1_reference
    assert results[0]["processes_left_by_save"] == []


def test_checkpoint_saved_at_tp1_resumes_at_tp2(model_dir, tp1_reference):
    (reference,), manager = tp1_reference
    resumed = run_on_ranks(run, world_size=2, args=(model_dir, [2, 3]),
                           kwargs=dict(load_from=str(manager.latest()), tp=2))
    for rank in range(2):
        report = resumed[rank]["report"]
        assert report.optimizer_loaded and not report.rng_restored and '"tp": 1' in report.note
        assert resumed[rank]["lrs"] == pytest.approx(reference["lrs"][2:], abs=0)
        assert resumed[rank]["losses"] == pytest.approx(reference["losses"][2:], abs=1e-5)


def test_weights_only_load_leaves_the_optimizer_fresh(model_dir, tp1_reference):
    (reference,), manager = tp1_reference
    (loaded,) = run_on_ranks(run, world_size=1, args=(model_dir, []),
                             kwargs=dict(load_from=str(manager.latest()), load_optimizer=False))
    report = loaded["report"]
    assert not report.optimizer_loaded and not report.rng_restored
    assert_same_weights(loaded["weights"], reference["saved_weights"])
    assert loaded["optimizer_state_size"] == 0 and loaded["lr_now"] == 0.0  # no Adam state; warm-up starts at 0


def test_a_step_folder_exports_to_hf(model_dir, tp1_reference, tmp_path):
    from safetensors.torch import load_file

    (reference,), manager = tp1_reference
    run_on_ranks(export_to_hf, world_size=1, args=(str(manager.latest()), model_dir, str(tmp_path / "hf")))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    embedding = reference["saved_weights"]["embedding.word_embeddings.weight"]
    vocab = exported["model.embed_tokens.weight"].shape[0]
    assert torch.equal(exported["model.embed_tokens.weight"], embedding[:vocab])
    assert not torch.equal(exported["model.embed_tokens.weight"],
                           load_file(f"{model_dir}/model.safetensors")["model.embed_tokens.weight"])  # trained


def test_distributed_optimizer_state_reshards_from_dp2_to_dp1(model_dir, tmp_path):
    # fully_reshardable: the distributed optimizer's shards are written as whole per-parameter tensors
    reference, manager = reference_with_checkpoint(tmp_path, model_dir, 2, distributed_optimizer=True)
    latest = str(manager.latest())
    (resumed,) = run_on_ranks(run, world_size=1, args=(model_dir, [2, 3]),
                              kwargs=dict(load_from=latest, distributed_optimizer=True))
    assert resumed["report"].optimizer_loaded and not resumed["report"].rng_restored  # another layout
    assert resumed["lrs"] == reference[0]["lrs"][2:]
    assert resumed["losses"] == pytest.approx(reference[0]["losses"][2:], abs=1e-5)
    # the regular optimizer cannot take the distributed one's state: a clear message, not a KeyError deep inside
    with pytest.raises(DistributedRunError, match=r"use_distributed_optimizer=True to resume"):
        run_on_ranks(run, world_size=1, args=(model_dir, [2, 3]), kwargs=dict(load_from=latest))
