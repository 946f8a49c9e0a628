"""Run health (mrl/algorithms/health.py): the step's figures from its rollouts, each whole-step condition named with
its figures and fix, and the stop after grpo.max_idle_steps idle steps. Real runs that provoke each condition:
tests/runs/test_runs_health.py."""

import re

import pytest
import torch

from mrl.algorithms.health import (PREFLIGHT_ROWS, ZERO_LOSS_STEPS, EnvironmentErrorGuard, EnvironmentFailing, IdleGuard, IdleTraining, ZeroLoss, check_prompt_budget, check_sft_rows,
                                   health_cell,
                                   health_metrics, health_summary, prompt_token_limit, env_reads_answers, step_causes)
from mrl.algorithms.rollout import Rollouts
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.data.arith import build_arith_tokenizer
from mrl.data.datasets import Problem
from mrl.data.templates import PromptTemplate


def rollouts(rewards, *, rejected=0, errors=0, responses=None, cut=None, answers=None, messages=()) -> Rollouts:
    flat = torch.tensor(rewards, dtype=torch.float32).view(-1)
    b = len(flat)
    return Rollouts(torch.zeros(b, 4, dtype=torch.long), torch.ones(b, 4), torch.zeros(b, 4), flat,
                    torch.full((b,), 2), torch.tensor(cut or [False] * b), num_reward_errors=errors,
                    num_prompts_rejected=rejected, responses=responses or ["7"] * b,
                    extracted_answers=answers or ["7"] * b, reward_errors=list(messages))


def config(**policy) -> MrlConfig:
    return MrlConfig.model_validate({"policy": {"max_total_sequence_length": 32, **policy},
                                     "generation": {"max_new_tokens": 4}})


def test_figures_by_hand():
    # 3 prompts x 2 samples: group 0 differs, groups 1 and 2 are uniform; 1 prompt of 3 rejected, 3 of 6 errors
    r = rollouts([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], rejected=1, errors=3)
    figures = health_metrics(r, r.rewards.view(3, 2))
    assert figures == {"train/prompts_rejected_fraction": pytest.approx(1 / 3),
                       "train/zero_variance_groups": pytest.approx(2 / 3), "train/reward_error_fraction": 0.5,
                       "train/unparsed_fraction": 0.0}
    # of 4 responses, 1 cut (not read) and 2 of the 3 that ended without an answer: 2/3; none counted when the
    # environment reads no answer (a resource server, a reward model)
    r = rollouts([[0.0, 0.0], [1.0, 0.0]], cut=[True, False, False, False], answers=[None, None, "3", None])
    assert health_metrics(r, r.rewards.view(2, 2))["train/unparsed_fraction"] == pytest.approx(2 / 3)
    assert health_metrics(r, r.rewards.view(2, 2), reads_answers=False)["train/unparsed_fraction"] == 0.0
    assert env_reads_answers(config()) and not env_reads_answers(MrlConfig.model_validate({"env": {"kind": "server"}}))


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
    alone = MrlConfig.model_validate({"grpo": {"num_generations_per_prompt": 1, "num_prompts_per_step": 256}})
    (cause,) = step_causes(alone, metrics, r)  # groups of one: the cause is the setting, not the model
    assert "grpo.num_generations_per_prompt is 1" in cause.message and "never answers" not in cause.message
    assert "grpo.num_generations_per_prompt=2 or more" in cause.message
    with_kl = MrlConfig.model_validate({"loss": {"kl_beta": 0.1}})
    (cause,) = step_causes(with_kl, metrics, r)
    assert not cause.idle and "only from the KL term" in cause.message


def test_the_advice_never_proposes_the_group_size_the_run_already_has():
    """The run that stopped has its own setting: proposing it again would be no fix (it proposed
    grpo.num_generations_per_prompt=4 to runs with 4)."""
    r = rollouts([[0.0, 0.0], [0.0, 0.0]])
    metrics = {**health_metrics(r, r.rewards.view(2, 2)), "train/kept_samples": 4.0}
    for size in (1, 2, 3, 4, 8, 16):
        cfg = MrlConfig.model_validate({"grpo": {"num_generations_per_prompt": size},
                                        "policy": {"train_global_batch_size": 32}})
        guard = IdleGuard(limit=1)
        guard.observe(1, step_causes(cfg, metrics, r))
        with pytest.raises(IdleTraining) as stopped:
            guard.stop_if_exhausted()
        proposed = [int(v) for v in re.findall(r"grpo\.num_generations_per_prompt=(\d+)", str(stopped.value))]
        assert proposed and all(value > size for value in proposed), (size, str(stopped.value))


def test_a_step_the_model_solves_whole_warns_but_is_not_idle():
    solved = rollouts([[1.0, 1.0], [1.0, 1.0]])
    metrics = {**health_metrics(solved, solved.rewards.view(2, 2)), "train/kept_samples": 0.0}
    (cause,) = step_causes(config(), metrics, solved)
    assert cause.name == "all solved" and not cause.idle and "same reward, 1:" in cause.message
    guard = IdleGuard(limit=3)
    for step in range(1, 10):  # a run that keeps solving its problems is not stopped
        guard.observe(step, [cause])
        guard.stop_if_exhausted()
    # uniform groups of different rewards (one all right, one all wrong) stay idle: no group has a signal
    split = rollouts([[1.0, 1.0], [0.0, 0.0]])
    (cause,) = step_causes(config(), {**health_metrics(split, split.rewards.view(2, 2)), "train/kept_samples": 0.0},
                           split)
    assert cause.name == "equal rewards" and cause.idle and "rewards seen: 0, 1" in cause.message


def test_cut_responses_and_failed_rewards_warn_but_are_not_idle():
    # one response cut, the other an end-of-sequence token alone (empty): nothing was said to its end
    r = rollouts([[0.0, 1.0]], errors=2, responses=["12", ""], cut=[True, False],
                 messages=["the gold answer 'seven' is not an integer"])
    metrics = {**health_metrics(r, r.rewards.view(1, 2)), "train/kept_samples": 2.0}
    causes = step_causes(config(), metrics, r)
    assert [c.name for c in causes] == ["responses cut", "reward failed"] and not any(c.idle for c in causes)
    assert "generation.max_new_tokens=4" in causes[0].message and "(1 of 2 were empty)" in causes[0].message
    assert "the gold answer 'seven' is not an integer" in causes[1].message
    ended = rollouts([[0.0, 1.0]], responses=["12", ""], cut=[False, False])  # the empty one ended: not all cut
    assert step_causes(config(), {**health_metrics(ended, ended.rewards.view(1, 2)), "train/kept_samples": 2.0},
                       ended) == []


def test_responses_without_an_answer_quote_one_and_name_the_format_the_reward_reads():
    r = rollouts([[0.0, 1.0]], responses=["the answer is seven", "abc"], answers=[None, None])
    metrics = {**health_metrics(r, r.rewards.view(1, 2)), "train/kept_samples": 2.0}
    (cause,) = step_causes(config(), metrics, r)  # env.kind math by default
    assert cause.name == "no answer found" and not cause.idle
    assert "'the answer is seven'" in cause.message and "the last \\boxed{...}" in cause.message
    arith = MrlConfig.model_validate({**config().model_dump(), "env": {"kind": "arith"}})
    assert "the first integer of the response" in step_causes(arith, metrics, r)[0].message


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


def problems(*texts: str) -> list[Problem]:
    return [Problem(text, "0") for text in texts]


def test_a_template_and_instruction_longer_than_the_budget_stop_the_run_before_it_starts():
    tok = build_arith_tokenizer()  # one token per character
    cfg = config()  # 32 - 4: a prompt may take 28 tokens
    check_prompt_budget(cfg, tok, PromptTemplate("plain", "=" * 22), problems("1+2="))  # "1+2= " + 22: 27
    with pytest.raises(ConfigError, match=r"data.instruction: the prompt template and instruction alone take 29 "
                                          r"tokens, more than the 28") as caught:
        check_prompt_budget(cfg, tok, PromptTemplate("plain", "=" * 28), problems("1+2="))  # " " + 28
    assert "shorten data.instruction" in str(caught.value)
    truncating = MrlConfig.model_validate({**cfg.model_dump(), "generation": {"max_new_tokens": 4,
                                                                               "overlong_prompt": "truncate"}})
    with pytest.raises(ConfigError, match="alone take 29"):  # truncation would cut every problem away
        check_prompt_budget(truncating, tok, PromptTemplate("plain", "=" * 28), problems("1+2="))  # " " + 28


def test_first_rows_all_over_the_budget_are_counted_unless_one_fits_or_they_are_truncated():
    tok = build_arith_tokenizer()
    cfg = config(max_total_sequence_length=12)  # 12 - 4: 8 tokens
    long_rows = problems(*["1+2+3+4+5=" for _ in range(PREFLIGHT_ROWS + 10)])  # 10 tokens each
    with pytest.raises(ConfigError, match=rf"all {PREFLIGHT_ROWS} of the first {PREFLIGHT_ROWS} training prompts "
                                          r"exceed the 8 tokens .*shortest 10, longest 10") as caught:
        check_prompt_budget(cfg, tok, PromptTemplate("plain", ""), long_rows)
    assert "generation.overlong_prompt=truncate" in str(caught.value)
    with pytest.raises(ConfigError, match=rf"all {PREFLIGHT_ROWS} of the first {PREFLIGHT_ROWS} validation prompts "
                                          r"\(eval.data\) exceed the 8 tokens"):  # validation would generate nothing
        check_prompt_budget(cfg, tok, PromptTemplate("plain", ""), long_rows, rows="validation", source="eval.data")
    check_prompt_budget(cfg, tok, PromptTemplate("plain", ""), problems("1+2=", *["1+2+3+4+5="] * 5))  # one fits
    check_prompt_budget(cfg, tok, PromptTemplate("plain", ""), [])  # no training rows (mrl eval's data)
    capped = MrlConfig.model_validate({**cfg.model_dump(), "data": {"max_prompt_length": 3}})
    with pytest.raises(ConfigError, match=r"(?s)exceed the 3 tokens.*raise data.max_prompt_length"):
        check_prompt_budget(capped, tok, PromptTemplate("plain", ""), problems("1+2="))
    truncating = MrlConfig.model_validate({**cfg.model_dump(), "generation": {"max_new_tokens": 4,
                                                                               "overlong_prompt": "truncate"}})
    check_prompt_budget(truncating, tok, PromptTemplate("plain", ""), long_rows)


def test_the_run_summary_counts_warned_and_idle_steps_and_averages_each_figure():
    history = {"train/health_warnings": [(1, 2.0), (2, 1.0), (3, 0.0)], "train/idle": [(1, 1.0), (2, 0.0), (3, 0.0)],
               "train/zero_variance_groups": [(1, 1.0), (2, 0.5), (3, 0.0)],
               "train/truncated_fraction": [(1, 1.0), (2, 1.0), (3, 0.25)],
               "val/truncated_fraction": [(0, 0.5), (3, 0.125)]}
    summary = health_summary(history)
    assert summary == {"steps_warned": 2, "steps_idle": 1, "prompts_rejected_fraction": None,
                       "zero_variance_groups": 0.5, "reward_error_fraction": None, "unparsed_fraction": None,
                       "truncated_fraction": 0.75,
                       "val_truncated_fraction": 0.125, "val_reward_error_fraction": None}
    assert health_cell({"health": summary}) == "2 warned, 1 idle"
    assert health_cell({"health": health_summary({"train/health_warnings": [(1, 0.0)]})}) == "ok"
    assert health_cell({"algorithm": "dpo"}) == "-"  # no step health for pair training yet


def short(length: int) -> MrlConfig:
    return MrlConfig.model_validate({"policy": {"max_total_sequence_length": length},
                                     "generation": {"max_new_tokens": 1}})


def test_sft_rows_whose_prompts_fill_the_length_stop_the_run_and_rows_all_over_it_warn(capsys):
    tok, plain = build_arith_tokenizer(), PromptTemplate("plain", "")
    rows = [Problem("1+2=", "3"), Problem("37+05=", "42")]  # prompts 4 and 6 tokens, rows 6 and 9 with the EOS
    with pytest.raises(ConfigError, match=r"(?s)policy.max_total_sequence_length: all 2 of the first 2 training rows "
                                          r"have a prompt of 4 tokens or more \(shortest 4, longest 6\).*given: 4"):
        check_sft_rows(short(4), tok, plain, rows)
    check_sft_rows(short(5), tok, plain, rows)  # every row is cut: a warning
    assert "all 2 of the first 2 training rows are longer than policy.max_total_sequence_length=5 (shortest 6, " \
           "longest 9 tokens)" in capsys.readouterr().err
    check_sft_rows(short(6), tok, plain, rows)  # one row fits whole: silent
    check_sft_rows(short(6), tok, plain, [])
    assert capsys.readouterr().err == ""


def test_a_loss_of_exactly_0_warns_once_per_run_of_such_steps(capsys):
    watch = ZeroLoss("dpo")
    losses = [0.69, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1e-30]
    for step, loss in enumerate(losses, start=1):
        watch.observe(step, {"train/loss": loss, "train/grad_norm": 0.0})
    err = capsys.readouterr().err
    assert ZERO_LOSS_STEPS == 2
    assert re.findall(r"step (\d): train/loss has been exactly 0 for 2 steps in a row", err) == ["3", "7"]
    assert "(train/grad_norm 0)" in err and "no response token in the pairs" in err
    assert "every answer token masked" in _warned(ZeroLoss("sft"), capsys)


def _warned(watch: ZeroLoss, capsys) -> str:
    for step in (1, 2):
        watch.observe(step, {"train/loss": 0.0})
    return capsys.readouterr().err


def test_the_default_stops_a_run_after_3_idle_steps():
    assert MrlConfig().grpo.max_idle_steps == 3


def test_an_environment_failing_past_its_limit_stops_the_run_naming_it_and_none_never_stops():
    class Step:
        reward_errors = ["tool call 'email_send': down: ConnectError: [Errno 111] Connection refused"]

    mixed = {"train/env/tools/reward_error_fraction": 0.75, "train/env/add/reward_error_fraction": 0.0,
             "train/reward_error_fraction": 0.25}
    guard = EnvironmentErrorGuard(0.5)
    guard.observe(7, mixed, Step())
    with pytest.raises(EnvironmentFailing) as stopped:
        guard.stop_if_exhausted()
    message = str(stopped.value)
    assert "step 7" in message and "tools on 75% of its samples" in message and "add" not in message
    assert "Connection refused" in message and "grpo.max_env_error_fraction=0.5" in message
    guard.observe(8, {**mixed, "train/env/tools/reward_error_fraction": 0.5}, Step())  # at the limit: goes on
    guard.stop_if_exhausted()
    single = EnvironmentErrorGuard(0.0)
    single.observe(1, {"train/reward_error_fraction": 0.125}, Step())  # a run with one environment: its overall figure
    with pytest.raises(EnvironmentFailing, match="the environment on 12%"):
        single.stop_if_exhausted()
    never = EnvironmentErrorGuard(None)
    never.observe(1, {"train/reward_error_fraction": 1.0}, Step())
    never.stop_if_exhausted()
