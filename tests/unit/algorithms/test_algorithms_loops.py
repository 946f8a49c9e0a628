"""The training loops' control paths with fakes (mrl/testing/fake_workers.py), milliseconds each: GRPO (synchronous
and one step ahead), SFT, and the DPO / reward-model loop; validation and checkpoint schedules, SIGTERM, resume, the
idle and non-finite stops, skipped refits. Configs are the embedded recipe's (recipes/arith-tiny-cpu.yaml), made
small by overrides. Every expected call sequence below is derived by hand from the loops' documented rules."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from mrl.algorithms.dpo import dpo_train
from mrl.algorithms.grpo import grpo_train
from mrl.algorithms.guards import NonFiniteTraining
from mrl.algorithms.health import IdleTraining
from mrl.algorithms.pairs import PairData, load_pair_data
from mrl.algorithms.rm import rm_train
from mrl.algorithms.sft import sft_train
from mrl.config import MrlConfig, load_config
from mrl.data.tasks import TaskData, load_task_data
from mrl.environments.arith import ArithEnvironment
from mrl.logging.metrics import MetricsLogger
from mrl.testing.fake_workers import FakeCheckpoints, FakeWorkers

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-cpu.yaml"
SMALL = (
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=4",  # GRPO: one update a step; SFT: 4 rows; DPO / RM: 2 pairs
    "policy.train_micro_batch_size=4",
    "eval.num_samples=1",
    "eval.pass_k=[1]",
    "eval.max_problems=2",
    "checkpointing.save_every=50",
    "grpo.val_every=0",
)
#: One step ahead (grpo.max_off_policy_steps=1) and what the config requires with it.
AHEAD = (
    "grpo.max_off_policy_steps=1",
    "loss.importance_sampling=tis",
    "generation.colocated=false",
    "generation.num_devices=1",
    "cluster.devices_per_node=2",
)


def config(tmp_path: Path, *overrides: str) -> MrlConfig:
    return load_config(RECIPE, [*SMALL, f"run.output_dir={tmp_path}", *overrides])


@functools.cache
def _arith_data() -> TaskData:
    return load_task_data(load_config(RECIPE))


def task_data(num_train: int | None = None) -> TaskData:
    """The arith task with 3 validation problems (and the first `num_train` training ones)."""
    data = _arith_data()
    return TaskData(data.train[:num_train], data.val[:3], data.template, arith=data.arith)


@pytest.fixture(autouse=True, scope="module")
def _loaded_once():
    """The arith task and its preference pairs, loaded once for the module (~1 s with the first imports)."""
    _arith_data()
    _arith_pairs()


def right(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def wrong(prompt: str) -> str:
    return str(int(right(prompt)) + 1)


def half_right(step: int | None, prompt: str, k: int) -> str:
    """Sample 0 of each group right, the others wrong: every group has a reward signal."""
    return right(prompt) if k == 0 else wrong(prompt)


def idle_at(*steps: int):
    """Every sample of `steps` wrong (every group's rewards equal: idle, no KL term in the recipe), else half right."""
    return lambda step, prompt, k: wrong(prompt) if step in steps else half_right(step, prompt, k)


def stop_at_update(ckpt: FakeCheckpoints, workers: FakeWorkers, update: int) -> None:
    """SIGTERM's flag raised while the policy trains its `update`-th update."""

    def on_train(n: int) -> None:
        ckpt.stop_requested = ckpt.stop_requested or n == update

    workers.fake_policy.on_train = on_train


def run_grpo(cfg: MrlConfig, workers: FakeWorkers, ckpt: FakeCheckpoints, data: TaskData | None = None):
    logger = MetricsLogger([])
    final = grpo_train(cfg, workers, ArithEnvironment(), data or task_data(), logger, ckpt)
    return logger, final


def steps_logged(logger: MetricsLogger, name: str) -> list[int]:
    return [step for step, _ in logger.history.get(name, [])]


def values_logged(logger: MetricsLogger, name: str) -> list[float]:
    return [value for _, value in logger.history.get(name, [])]


def calls(workers: FakeWorkers, *kinds: str) -> list[tuple]:
    """The run's calls of `kinds` (all when none) as (kind, step, version), in order."""
    return [(e.kind, e.step, e.version) for e in workers.events.all() if not kinds or e.kind in kinds]


# ------------------------------------------------------------------------------------------------- GRPO, synchronous
def test_grpo_step_is_generate_train_refit_and_validation_comes_at_0_every_val_every_and_last(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=5", "grpo.val_every=2")
    workers = FakeWorkers(cfg, half_right)
    ckpt = FakeCheckpoints(cfg, workers)
    logger, final = run_grpo(cfg, workers, ckpt)
    step = lambda n: [("generate", n, n - 1), ("train", None, n), ("refit", None, n)]  # noqa: E731
    val = lambda v: [("validate", None, v)]  # noqa: E731
    assert calls(workers) == [
        ("resume", None, 0),
        *val(0),
        *step(1),
        *step(2),
        *val(2),
        *step(3),
        *step(4),
        *val(4),
        *step(5),
        *val(5),
        ("save", 5, 5),  # the last step only: checkpointing.save_every=50
    ]
    assert steps_logged(logger, "val/accuracy") == [0, 2, 4, 5]
    assert values_logged(logger, "val/accuracy") == [1.0] * 4  # eval.num_samples=1: sample 0 of each, the right one
    assert sorted(p.name for p in (tmp_path / "val_samples").iterdir()) == [f"step_{n}.jsonl" for n in (0, 2, 4, 5)]
    assert values_logged(logger, "train/reward") == [0.5] * 5 and final["train/reward"] == 0.5
    assert ckpt.interrupted_at is None


def test_grpo_logs_the_generation_memory_where_the_controller_holds_a_gpu(tmp_path, monkeypatch):
    """An in-process engine on a GPU: every step logs the device's memory in use and the allocator's peak as
    generation ends (through the real logger, whose metric names are checked), and resets the peak per step."""
    cfg = config(tmp_path, "grpo.max_num_steps=2")
    peaks = iter([3 * 2**30, 5 * 2**30])
    resets = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(peaks))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(1))
    logger, _ = run_grpo(cfg, FakeWorkers(cfg, half_right), FakeCheckpoints(cfg, FakeWorkers(cfg, half_right)))
    assert values_logged(logger, "memory/generation_device_used_gib") == [80.0, 80.0]
    assert values_logged(logger, "memory/generation_engine_peak_gib") == [3.0, 5.0]
    assert len(resets) == 2


def test_grpo_without_val_every_validates_before_the_first_step_and_after_the_last(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=3")
    workers = FakeWorkers(cfg, half_right)
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert steps_logged(logger, "val/accuracy") == [0, 3]


def test_grpo_without_validation_data_skips_validation_and_says_so_once(tmp_path, capsys):
    cfg = config(tmp_path, "grpo.max_num_steps=3", "grpo.val_every=1")
    workers = FakeWorkers(cfg, half_right)
    data = task_data()
    logger = MetricsLogger([])
    grpo_train(
        cfg, workers, ArithEnvironment(), TaskData(data.train, [], data.template), logger, FakeCheckpoints(cfg, workers)
    )
    assert workers.events.of("validate") == [] and not any(name.startswith("val/") for name in logger.history)
    assert capsys.readouterr().err.count("validation is skipped") == 1
    assert [e.step for e in workers.events.of("generate")] == [1, 2, 3]


def test_grpo_saves_every_save_every_steps_and_after_the_last_never_when_checkpointing_is_off(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=5", "checkpointing.save_every=2")
    workers = FakeWorkers(cfg, half_right)
    ckpt = FakeCheckpoints(cfg, workers)
    run_grpo(cfg, workers, ckpt)
    assert calls(workers, "save") == [("save", 2, 2), ("save", 4, 4), ("save", 5, 5)]
    assert sorted(ckpt.saved) == [2, 4, 5] and ckpt.saved[4]["in_flight"] is None

    cfg = config(tmp_path, "grpo.max_num_steps=5", "checkpointing.save_every=2", "checkpointing.enabled=false")
    workers = FakeWorkers(cfg, half_right)
    run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert calls(workers, "save") == []


def test_grpo_ends_when_the_data_is_used_up_with_validation_and_a_save(tmp_path):
    # 4 problems, 2 a step, grpo.max_num_epochs=1: step 2 is the last, whatever grpo.max_num_steps says
    cfg = config(tmp_path, "grpo.max_num_steps=10")
    workers = FakeWorkers(cfg, half_right)
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers), task_data(num_train=4))
    assert [e.step for e in workers.events.of("generate")] == [1, 2]
    assert steps_logged(logger, "val/accuracy") == [0, 2] and calls(workers, "save") == [("save", 2, 2)]


def test_grpo_several_updates_a_step_take_the_old_logprobs_once_before_them(tmp_path):
    # 2 prompts x 2 samples = 4 rows; 3 data-parallel ranks: padded to 6 rows, 3 per update (2 rounded up to 3)
    cfg = config(
        tmp_path, "grpo.max_num_steps=2", "policy.train_global_batch_size=2", "policy.train_micro_batch_size=2"
    )
    workers = FakeWorkers(cfg, half_right, data_parallel_size=3)
    run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    kinds = [k for k in workers.events.kinds() if k in ("generate", "logprobs", "train", "refit")]
    assert kinds == ["generate", "logprobs", "train", "train", "refit"] * 2
    assert [len(batch) for batch in workers.fake_policy.trained] == [3, 3, 3, 3]
    padding = workers.fake_policy.trained[1]  # rows 4 and 5 repeat row 0 with no loss token
    assert padding.loss_mask[1:].sum() == 0 and padding.loss_mask[0].sum() > 0


def test_grpo_sigterm_saves_after_the_step_in_flight_and_stops(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=5")
    workers = FakeWorkers(cfg, half_right)
    ckpt = FakeCheckpoints(cfg, workers)
    stop_at_update(ckpt, workers, 2)
    logger, final = run_grpo(cfg, workers, ckpt)
    assert calls(workers) == [
        ("resume", None, 0),
        ("validate", None, 0),
        ("generate", 1, 0),
        ("train", None, 1),
        ("refit", None, 1),
        ("generate", 2, 1),
        ("train", None, 2),
        ("refit", None, 2),
        ("save", 2, 2),  # not due by save_every (50): due because of the SIGTERM; no validation, not the last step
    ]
    assert ckpt.interrupted_at == 2 and steps_logged(logger, "train/reward") == [1, 2]
    assert final is not None and "val/accuracy" not in final


def _straight_and_stopped_at_update_2(cfg):
    """An uninterrupted run, and one that a SIGTERM stops during its second update (its workers and checkpoints)."""
    straight = FakeWorkers(cfg, half_right)
    run_grpo(cfg, straight, FakeCheckpoints(cfg, straight))
    first = FakeWorkers(cfg, half_right)
    stopped = FakeCheckpoints(cfg, first)
    stop_at_update(stopped, first, 2)
    run_grpo(cfg, first, stopped)
    return straight, first, stopped


def test_grpo_resume_continues_from_the_next_step_with_the_saved_data_position_and_weights(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4")
    straight, first, stopped = _straight_and_stopped_at_update_2(cfg)

    resumed = FakeWorkers(cfg, half_right)
    logger, _ = run_grpo(cfg, resumed, FakeCheckpoints(cfg, resumed, resume=stopped.newest()))
    assert calls(resumed) == [
        ("resume", 2, 0),
        ("refit", None, 2),  # the engine gets the resumed weights; no validation before the first step
        ("generate", 3, 2),
        ("train", None, 3),
        ("refit", None, 3),
        ("generate", 4, 3),
        ("train", None, 4),
        ("refit", None, 4),
        ("validate", None, 4),
        ("save", 4, 4),
    ]
    assert [e.detail for e in resumed.events.of("generate")] == [e.detail for e in straight.events.of("generate")][2:]
    assert steps_logged(logger, "val/accuracy") == [4]


# ------------------------------------------------------------------------------------------ GRPO, one step ahead
def _trained_steps(workers: FakeWorkers) -> list[torch.Tensor]:
    return [batch.input_ids for batch in workers.fake_policy.trained]


def test_grpo_ahead_generates_each_step_from_the_weights_one_update_older(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4", *AHEAD)
    workers = FakeWorkers(cfg, half_right)
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    # step n generates (during step n-1's training) from the weights after step n-2; step 1 and 2 from the start
    assert calls(workers, "generate") == [
        ("generate", 1, 0),
        ("generate", 2, 0),
        ("generate", 3, 1),
        ("generate", 4, 2),
    ]
    # refits before generating steps 3 and 4, then to the newest weights before the last validation
    assert calls(workers, "refit") == [("refit", None, 1), ("refit", None, 2), ("refit", None, 4)]
    assert calls(workers, "validate") == [("validate", None, 0), ("validate", None, 4)]
    assert values_logged(logger, "train/staleness") == [0.0, 1.0, 1.0, 1.0]


def test_grpo_ahead_sigterm_saves_the_generation_in_flight_and_resume_trains_on_it(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4", *AHEAD)
    straight, first, stopped = _straight_and_stopped_at_update_2(cfg)
    assert calls(first, "save") == [("save", 2, 2)] and stopped.interrupted_at == 2
    in_flight = stopped.saved[2]["in_flight"]
    assert in_flight["step"] == 3 and in_flight["rollouts"]["policy_version"] == 1  # generated from step 1's weights

    resumed = FakeWorkers(cfg, half_right)
    run_grpo(cfg, resumed, FakeCheckpoints(cfg, resumed, resume=stopped.newest()))
    # step 3 trains on the saved samples (never generated again); step 4 generates from step 2's weights, as the
    # uninterrupted run did
    assert calls(resumed, "generate") == [("generate", 4, 2)]
    assert calls(resumed, "refit") == [("refit", None, 2), ("refit", None, 4)]  # the resumed weights; the last val
    assert all(torch.equal(a, b) for a, b in zip(_trained_steps(resumed), _trained_steps(straight)[2:], strict=True))
    assert calls(resumed, "save") == [("save", 4, 4)]


# ----------------------------------------------------------------------------------------- GRPO, the stops
def test_grpo_idle_steps_in_a_row_stop_the_run_before_it_saves_the_last(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=6", "checkpointing.save_every=1")  # grpo.max_idle_steps: 3
    workers = FakeWorkers(cfg, idle_at(1, 2, 3, 4, 5, 6))
    with pytest.raises(IdleTraining, match=r"steps 1\.\.3 trained on nothing"):
        run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert [e.step for e in workers.events.of("generate")] == [1, 2, 3]
    assert calls(workers, "save") == [("save", 1, 1), ("save", 2, 2)]  # not step 3


def test_grpo_a_step_with_signal_resets_the_idle_count(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=6")
    workers = FakeWorkers(cfg, idle_at(1, 2, 4, 5))
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert values_logged(logger, "train/idle") == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]

    workers = FakeWorkers(cfg, idle_at(1, 3, 4, 5))
    with pytest.raises(IdleTraining, match=r"steps 3\.\.5"):
        run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))


def test_grpo_all_solved_steps_are_not_idle(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4")
    workers = FakeWorkers(cfg, lambda step, prompt, k: right(prompt))
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert (
        values_logged(logger, "train/idle") == [0.0] * 4 and values_logged(logger, "train/health_warnings") == [1.0] * 4
    )


def test_grpo_nothing_kept_trains_nothing_and_counts_as_idle(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=5", "grpo.dynamic_sampling=true")
    workers = FakeWorkers(cfg, idle_at(1, 2, 3, 4, 5))
    with pytest.raises(IdleTraining, match=r"steps 1\.\.3"):
        run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert workers.events.of("train") == [] and workers.events.of("logprobs") == []


def test_grpo_non_finite_steps_in_a_row_stop_the_run_and_are_never_refitted(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=6", "checkpointing.save_every=1")  # policy.max_nonfinite_steps: 3
    workers = FakeWorkers(cfg, half_right, nonfinite=lambda update: True)
    with pytest.raises(NonFiniteTraining, match=r"steps 1\.\.3"):
        run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert calls(workers, "train") == [("train", None, 0)] * 3
    assert calls(workers, "refit") == []
    assert calls(workers, "save") == [("save", 1, 0), ("save", 2, 0)]  # not step 3


def test_grpo_skips_the_refit_after_a_non_finite_step_only(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4")
    workers = FakeWorkers(cfg, half_right, nonfinite=lambda update: update in (2, 3))
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert calls(workers, "generate", "train", "refit") == [
        ("generate", 1, 0),
        ("train", None, 1),
        ("refit", None, 1),
        ("generate", 2, 1),
        ("train", None, 1),  # skipped: no refit
        ("generate", 3, 1),
        ("train", None, 1),  # skipped: no refit (two in a row, under the limit of 3)
        ("generate", 4, 1),
        ("train", None, 2),
        ("refit", None, 2),
    ]
    assert values_logged(logger, "train/nonfinite_steps") == [0.0, 1.0, 2.0, 2.0]


# ------------------------------------------------------------------------------------------- PPO and distillation
def test_ppo_trains_the_critic_then_the_policy_each_step_and_only_the_critic_while_it_warms_up(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=3", "grpo.advantage_estimator=gae", "ppo.critic_warmup_steps=1",
                 "ppo.whiten_advantages=false", "ppo.lam=1.0", "ppo.gamma=1.0")
    workers = FakeWorkers(cfg, half_right, critic=True)
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    kinds = ("generate", "logprobs", "critic.logprobs", "critic.train", "train", "refit")
    critic = [("critic.logprobs", None, 0), ("critic.train", None, 1)]
    assert calls(workers, *kinds) == [
        ("generate", 1, 0), *critic, ("refit", None, 0),  # warm-up: the policy's weights stay
        ("generate", 2, 0), ("critic.logprobs", None, 1), ("critic.train", None, 2), ("train", None, 1),
        ("refit", None, 1),
        ("generate", 3, 1), ("critic.logprobs", None, 2), ("critic.train", None, 3), ("train", None, 2),
        ("refit", None, 2),
    ]
    assert values_logged(logger, "train/critic_warmup") == [1.0]
    # gamma = lambda = 1: A_t = reward - V_t and the critic's target R_t = reward on every response token. The fake
    # critic scores every loss token -0.5, so V is 0 for a response's first token (read at the prompt's last) and
    # -0.5 for the others: A = reward there, reward + 0.5 after.
    batch = workers.fake_policy.trained[0]
    mask = batch.loss_mask > 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # half_right: sample 0 of each group right
    first = mask & ~torch.roll(mask, 1, dims=1)
    want = (rewards[:, None] + 0.5 * (mask & ~first)) * mask
    assert torch.allclose(batch.token_data["advantages"], want)
    critic_batch = workers.critic.trained[1]  # type: ignore[union-attr]
    assert torch.allclose(critic_batch.token_data["returns"], rewards[:, None] * mask)
    assert torch.allclose(critic_batch.token_data["old_values"], -0.5 * (mask & ~first))


def test_distillation_advantage_is_the_teachers_logprob_minus_the_students_plus_the_weighted_reward(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=1", "+distillation.teacher=unused", "distillation.kl_weight=2.0",
                 "distillation.reward_weight=0.5")
    workers = FakeWorkers(cfg, half_right, teacher=-0.2)
    logger, _ = run_grpo(cfg, workers, FakeCheckpoints(cfg, workers))
    assert calls(workers, "generate", "logprobs", "teacher.logprobs", "train") == [
        ("generate", 1, 0), ("logprobs", None, 0), ("teacher.logprobs", None, 0), ("train", None, 1),
    ]
    batch = workers.fake_policy.trained[0]
    mask = batch.loss_mask > 0
    # student -0.5, teacher -0.2 per token: 2.0 * 0.3; GRPO's advantages of a right and a wrong sample, std-normalised
    # without leave-one-out (the recipe): +-0.7071 (unbiased std of {1, 0} is 0.7071), times 0.5
    group = torch.tensor([1.0, -1.0, 1.0, -1.0]) / 2**0.5
    assert torch.allclose(batch.token_data["advantages"], (0.6 + 0.5 * group[:, None]) * mask, atol=1e-6)
    assert values_logged(logger, "train/distill/reverse_kl") == [pytest.approx(-0.3)]


# ------------------------------------------------------------------------------------------------------------- SFT
def run_sft(cfg: MrlConfig, workers: FakeWorkers, ckpt: FakeCheckpoints) -> MetricsLogger:
    logger = MetricsLogger([])
    sft_train(cfg, workers, task_data(), logger, ckpt)
    return logger


def test_sft_trains_max_num_steps_validates_every_val_every_and_last_saves_when_due(tmp_path):
    cfg = config(tmp_path, "sft.max_num_steps=5", "sft.val_every=2", "checkpointing.save_every=2")
    workers = FakeWorkers(cfg)
    logger = run_sft(cfg, workers, FakeCheckpoints(cfg, workers))
    step = lambda n: [("train", None, n)]  # noqa: E731
    val = lambda v: [("logprobs", None, v)]  # noqa: E731  # 3 validation rows: one logprobs call
    assert calls(workers) == [
        ("resume", None, 0),
        *step(1),
        *step(2),
        *val(2),
        ("save", 2, 2),
        *step(3),
        *step(4),
        *val(4),
        ("save", 4, 4),
        *step(5),
        *val(5),
        ("save", 5, 5),
    ]
    assert steps_logged(logger, "val/loss") == [2, 4, 5]  # no validation before the first step (SFT)
    assert [len(batch) for batch in workers.fake_policy.trained] == [4] * 5  # policy.train_global_batch_size


def test_sft_sigterm_saves_and_stops_and_resume_draws_the_same_examples(tmp_path):
    cfg = config(tmp_path, "sft.max_num_steps=4")
    straight = FakeWorkers(cfg)
    run_sft(cfg, straight, FakeCheckpoints(cfg, straight))

    first = FakeWorkers(cfg)
    stopped = FakeCheckpoints(cfg, first)
    stop_at_update(stopped, first, 2)
    run_sft(cfg, first, stopped)
    assert calls(first, "train", "save") == [("train", None, 1), ("train", None, 2), ("save", 2, 2)]
    assert stopped.interrupted_at == 2

    resumed = FakeWorkers(cfg)
    logger = run_sft(cfg, resumed, FakeCheckpoints(cfg, resumed, resume=stopped.newest()))
    assert calls(resumed, "train", "save") == [("train", None, 3), ("train", None, 4), ("save", 4, 4)]
    assert steps_logged(logger, "train/loss") == [3, 4]
    # the arith task's example stream continues where it was saved: the uninterrupted run's steps 3 and 4
    assert all(torch.equal(a, b) for a, b in zip(_trained_steps(resumed), _trained_steps(straight)[2:], strict=True))


def test_sft_non_finite_steps_in_a_row_stop_the_run_before_it_saves(tmp_path):
    cfg = config(tmp_path, "sft.max_num_steps=6", "checkpointing.save_every=1", "policy.max_nonfinite_steps=2")
    workers = FakeWorkers(cfg, nonfinite=lambda update: update >= 2)
    with pytest.raises(NonFiniteTraining, match=r"steps 2\.\.3"):
        run_sft(cfg, workers, FakeCheckpoints(cfg, workers))
    assert calls(workers, "train", "save") == [
        ("train", None, 1),
        ("save", 1, 1),
        ("train", None, 1),
        ("save", 2, 1),
        ("train", None, 1),
    ]


# ---------------------------------------------------------------------------------------------- DPO, reward model
@functools.cache
def _arith_pairs() -> PairData:
    cfg = load_config(RECIPE)
    return load_pair_data(cfg, FakeWorkers(cfg).tokenizer)


def pair_data() -> PairData:
    """The arith task's preference pairs: 16 for training, 3 for validation (prompts encoded once a session)."""
    data = _arith_pairs()
    return PairData(data.train[:16], data.val[:3], data.template)


def test_dpo_validates_at_0_every_val_every_and_last_with_reference_logprobs_before_each_update(tmp_path):
    cfg = config(tmp_path, "dpo.max_num_steps=3", "dpo.val_every=2", "checkpointing.save_every=2")
    workers = FakeWorkers(cfg)
    logger = MetricsLogger([])
    dpo_train(cfg, workers, pair_data(), logger, FakeCheckpoints(cfg, workers))
    kinds = [(e.kind, *e.detail, e.step) if e.kind == "logprobs" else (e.kind, e.step) for e in workers.events.all()]
    val = [("logprobs", "reference", None), ("logprobs", None)]  # 3 pairs: one call each
    step = [("logprobs", "reference", None), ("train", None)]
    assert kinds == [("resume", None), *val, *step, *step, *val, ("save", 2), *step, *val, ("save", 3)]
    assert steps_logged(logger, "val/loss") == [0, 2, 3]
    assert [len(batch) for batch in workers.fake_policy.trained] == [4] * 3  # 2 pairs, chosen and rejected rows


def test_dpo_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    cfg = config(tmp_path, "dpo.max_num_steps=5")
    workers = FakeWorkers(cfg, nonfinite=lambda update: True)
    with pytest.raises(NonFiniteTraining, match=r"steps 1\.\.3"):
        dpo_train(cfg, workers, pair_data(), MetricsLogger([]), FakeCheckpoints(cfg, workers))
    assert len(workers.events.of("train")) == 3 and workers.events.of("save") == []


def test_rm_sigterm_saves_and_stops_and_resume_trains_the_same_pairs(tmp_path):
    cfg = config(tmp_path, "rm.max_num_steps=4")

    def run(workers: FakeWorkers, ckpt: FakeCheckpoints) -> MetricsLogger:
        logger = MetricsLogger([])
        rm_train(cfg, workers, pair_data(), logger, ckpt)
        return logger

    straight = FakeWorkers(cfg)
    run(straight, FakeCheckpoints(cfg, straight))
    first = FakeWorkers(cfg)
    stopped = FakeCheckpoints(cfg, first)
    stop_at_update(stopped, first, 2)
    logger = run(first, stopped)
    assert calls(first, "train", "save") == [("train", None, 1), ("train", None, 2), ("save", 2, 2)]
    assert stopped.interrupted_at == 2 and steps_logged(logger, "val/loss") == [0]

    resumed = FakeWorkers(cfg)
    logger = run(resumed, FakeCheckpoints(cfg, resumed, resume=stopped.newest()))
    assert calls(resumed) == [
        ("resume", 2, 0),  # no validation before the first step of a resumed run
        ("train", None, 3),
        ("train", None, 4),
        ("logprobs", None, 4),  # the scores of the 3 validation pairs, after the last step
        ("save", 4, 4),
    ]
    assert steps_logged(logger, "val/loss") == [4]
    assert all(torch.equal(a, b) for a, b in zip(_trained_steps(resumed), _trained_steps(straight)[2:], strict=True))
