"""Run health (mrl/algorithms/health.py): the step's figures from its rollouts, each whole-step condition named with
its figures and fix, and the stop after grpo.max_idle_steps idle steps. Real runs that provoke each condition:
tests/functional/app/test_app_health.py."""

import pytest
import torch

from mrl.algorithms.health import IdleGuard, IdleTraining, health_metrics, prompt_token_limit, step_causes
from mrl.algorithms.rollout import Rollouts
from mrl.config.schema import MrlConfig


def rollouts(rewards, *, rejected=0, errors=0, responses=None) -> Rollouts:
    flat = torch.tensor(rewards, dtype=torch.float32).view(-1)
    b = len(flat)
    return Rollouts(torch.zeros(b, 4, dtype=torch.long), torch.ones(b, 4), torch.zeros(b, 4), flat,
                    torch.full((b,), 2), torch.zeros(b, dtype=torch.bool), num_reward_errors=errors,
                    num_prompts_rejected=rejected, responses=responses or [""] * b)


def config(**policy) -> MrlConfig:
    return MrlConfig.model_validate({"policy": {"max_total_sequence_length": 32, **policy},
                                     "generation": {"max_new_tokens": 4}})


def test_figures_by_hand():
    # 3 prompts x 2 samples: group 0 differs, groups 1 and 2 are uniform; 1 prompt of 3 rejected, 3 of 6 errors
    r = rollouts([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], rejected=1, errors=3)
    figures = health_metrics(r, r.rewards.view(3, 2))
    assert figures == {"train/prompts_rejected_fraction": pytest.approx(1 / 3),
                       "train/zero_variance_groups": pytest.approx(2 / 3), "train/reward_error_fraction": 0.5}


def test_every_prompt_too_long_names_the_longest_the_limit_and_the_keys():
    cfg = config()
    assert prompt_token_limit(cfg) == 28  # 32 - 4 (generation.vllm.max_model_len unset)
    r = rollouts([[0.0, 0.0], [0.0, 0.0]], rejected=2)
    metrics = {**health_metrics(r, r.rewards.view(2, 2)), "train/kept_samples": 0.0, "train/prompt_tokens_max": 41.0}
    (cause,) = step_causes(cfg, metrics, r)
    assert cause.idle and "longest has 41 tokens" in cause.message and "may take 28" in cause.message
    assert "policy.max_total_sequence_length" in cause.message and "generation.overlong_prompt=truncate" in cause.message


def test_equal_rewards_are_idle_without_kl_and_name_the_rewards_seen():
    r = rollouts([[0.0, 0.0], [0.0, 0.0]])
    metrics = {**health_metrics(r, r.rewards.view(2, 2)), "train/kept_samples": 4.0}
    (cause,) = step_causes(config(), metrics, r)
    assert cause.idle and "rewards seen: 0" in cause.message and "never answers right" in cause.message
    with_kl = MrlConfig.model_validate({"loss": {"kl_beta": 0.1}})
    (cause,) = step_causes(with_kl, metrics, r)
    assert not cause.idle and "only from the KL term" in cause.message


def test_cut_responses_and_unreadable_answers_warn_but_are_not_idle():
    r = rollouts([[0.0, 1.0]], errors=2, responses=["the answer is seven", "7"])
    metrics = {**health_metrics(r, r.rewards.view(1, 2)), "train/kept_samples": 2.0, "train/truncated_fraction": 1.0}
    causes = step_causes(config(), metrics, r)
    assert [c.name for c in causes] == ["responses cut", "unreadable answers"] and not any(c.idle for c in causes)
    assert "generation.max_new_tokens=4" in causes[0].message and "'the answer is seven'" in causes[1].message


def test_a_healthy_step_has_no_cause():
    r = rollouts([[0.0, 1.0], [1.0, 0.5]])
    metrics = {**health_metrics(r, r.rewards.view(2, 2)), "train/kept_samples": 4.0, "train/truncated_fraction": 0.5}
    assert step_causes(config(), metrics, r) == []


def test_the_guard_stops_at_the_limit_in_a_row_and_a_healthy_step_resets_it(capsys):
    r = rollouts([[0.0, 0.0]])
    idle = step_causes(config(), {**health_metrics(r, r.rewards.view(1, 2)), "train/kept_samples": 2.0}, r)
    guard = IdleGuard(limit=3)
    for step, causes in enumerate([idle, idle, [], idle, idle], start=1):
        guard.observe(step, causes)
        guard.stop_if_exhausted()
    assert capsys.readouterr().err.count("every group's rewards were equal") == 4
    guard.observe(6, idle)
    with pytest.raises(IdleTraining, match=r"steps 4..6 trained on nothing \(3 in a row; grpo.max_idle_steps=3\)"):
        guard.stop_if_exhausted()
    never = IdleGuard(limit=0)
    for step in range(1, 10):
        never.observe(step, idle)
        never.stop_if_exhausted()
