"""Runs killed for real, and re-run: the same command resumes from the newest checkpoint and goes on exactly.

- The whole run killed with SIGKILL (the driver and every Ray process it started) after step 2's checkpoint, in
  synchronous and asynchronous GRPO, PPO (the policy and its critic, with a step of critic warm-up), on-policy
  distillation (a frozen teacher on a device of its own) and LoRA (adapters on a frozen base): the re-run resumes
  from step 2 and logs for steps 3-4 the training metrics of an uninterrupted run of the same seed (PPO: the
  critic's losses, values and explained variance among them). The LoRA run's export: the merged model, and the
  adapters alone, which HF PEFT puts on the starting model to give the merged model's logits.
- One policy worker killed mid-run: one message naming the group, rank and method, where the newest checkpoint is and
  that re-running the same command resumes, exit status 4; re-running it does resume.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from mrl.app.errors import RUN_FAILED_EXIT_CODE
from mrl.testing.runs import (
    RECIPE,
    SHORT_ARITH,
    Uninterrupted,
    finish,
    metrics,
    mrl,
    wait_for_file,
    warm_grpo_args,
    worker_pids,
)

# Two GRPO runs side by side, then a third: minutes each on an AVX2-only EPYC.
pytestmark = pytest.mark.timeout(1500)


#: Asynchronous GRPO on 2 cores: the engine and the policy on a bundle (a core) each.
ASYNC = ("grpo.max_off_policy_steps=1", "loss.importance_sampling=tis", "generation.colocated=false",
         "generation.num_devices=1", "cluster.devices_per_node=2", "cluster.omp_num_threads=1")


#: PPO: a critic warmed up for a step; its learning rate high enough that its weights move visibly each step.
PPO = ("grpo.advantage_estimator=gae", "ppo.critic_warmup_steps=1", "ppo.critic.optimizer.lr=1e-3")


def _distillation(warm: Path) -> tuple[str, ...]:
    """The warm model as its own teacher, on a device of its own (the second bundle; the policy and the engine share
    the first): the task's reward moves the student, so the teacher's signal is not 0."""
    return (f"+distillation.teacher={warm}", "distillation.reward_weight=1.0", "distillation.num_devices=1",
            "cluster.devices_per_node=2", "cluster.omp_num_threads=1")


#: LoRA: adapters of rank 8 on every linear, the base frozen (its checkpoint holds the adapters' Adam states alone).
LORA = ("+policy.lora.rank=8", "policy.optimizer.lr=3e-3")


@pytest.mark.parametrize("mode", ["sync", "async", "ppo", "distillation", "lora"])
def test_grpo_resumes_exactly_after_sigkill(warm, tmp_path, mode, request):
    """Asynchronous: the checkpoint after step 2 holds step 3's rollouts, generated during step 2's training.
    Synchronous: the uninterrupted run is the one the engine fault tests compare against (`sync_reference`)."""
    extra = {"async": ASYNC, "ppo": PPO, "distillation": _distillation(warm), "lora": LORA}.get(mode, ())
    crashed_dir = tmp_path / "crashed"
    if mode == "sync":
        uninterrupted = request.getfixturevalue("sync_reference")
    else:  # the two runs start side by side
        uninterrupted = Uninterrupted(warm_grpo_args(warm, tmp_path / "reference", *extra), tmp_path / "reference")
    proc = mrl(*warm_grpo_args(warm, crashed_dir, *extra))
    marker = crashed_dir / "checkpoints" / "step_2" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, and the Ray processes it started, die at once
    proc.wait()
    reference = uninterrupted.metrics()
    if mode == "async":  # step 1 samples the initial model; every later step the weights one update older
        assert [reference[step]["train/staleness"] for step in (1, 2, 3, 4)] == [0, 1, 1, 1]
        assert all(reference[step]["train/is_weight_mean"] != 1.0 for step in (2, 3, 4))  # the correction acts
    if mode == "ppo":  # the critic trains every step, the policy from step 2
        assert [reference[step].get("train/critic_warmup", 0.0) for step in (1, 2, 3, 4)] == [1.0, 0, 0, 0]
        assert len({reference[step]["train/critic/value_mean"] for step in (1, 2, 3, 4)}) == 4
    if mode == "distillation":
        assert reference[3]["train/distill/reverse_kl"] != 0.0  # the student has left its teacher

    out = finish(mrl(*warm_grpo_args(warm, crashed_dir, *extra)))
    assert "resuming from" in out and "step_2" in out
    resumed = metrics(crashed_dir / "logs")
    for step in (3, 4):
        # Asynchronous: the resumed run's engine got step 2's weights at resume, so its refits come a step apart.
        train = {k: v for k, v in reference[step].items()
                 if k.startswith("train/") and "time" not in k and not (mode == "async" and "refit" in k)}
        assert {k: resumed[step][k] for k in train} == train, step
    if mode == "lora":
        _check_lora_export(crashed_dir / "final_hf", warm)


def _check_lora_export(final: Path, warm: Path) -> None:
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mrl.app.results import LORA_ADAPTER_DIR

    adapter = final / LORA_ADAPTER_DIR
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(warm)
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    ids = torch.randint(3, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, before = merged(ids).logits, base(ids).logits
        got = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
    assert (want - before).abs().max() > 1e-3  # the adapters trained
    assert (got - want).abs().max() <= 1e-4



def test_a_dead_policy_worker_ends_the_run_with_one_message_and_a_rerun_resumes(tmp_path):
    args = ["sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={tmp_path}", "sft.max_num_steps=30",
            "checkpointing.save_every=10"]
    proc = mrl(*args)
    marker = tmp_path / "checkpoints" / "step_10" / "COMPLETE"
    wait_for_file(proc, marker)
    workers = worker_pids(proc.pid)  # SFT starts the policy's one rank, no engine
    assert len(workers) == 1, workers
    worker = workers[0]
    os.kill(worker, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == RUN_FAILED_EXIT_CODE, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "worker group 'policy' rank 0" in out and "died while running 'train'" in out, out[-3000:]
    newest = max(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert f"the newest checkpoint is {tmp_path / 'checkpoints' / f'step_{newest}'}" in out, out[-3000:]
    assert "resumes from it" in out
    rerun = finish(mrl(*args))
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{newest}'}" in rerun
    assert max(metrics(tmp_path / "logs")) == 30
