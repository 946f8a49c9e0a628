"""Several environments in one run (`envs` + `data.sources`): the config's refusals, the weighted mix, the loaded and
tagged problems, the dispatch of samples to their environments, and GRPO's per-environment metrics with fakes.

The run: two arithmetic sources scored by two environments, `small` (1-digit sums, weight 1) and `large` (2-digit
sums, weight 3). The fake engine answers 1-digit sums right in sample 0 of each group and wrong in the others, and
every 2-digit sum wrong; so `small`'s reward is 1/2 and `large`'s 0 at every step, whatever the draw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrl.algorithms.env_metrics import per_env_metrics
from mrl.algorithms.grpo import grpo_train
from mrl.algorithms.rollout import Rollouts
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.data.datasets import Problem
from mrl.data.tasks import load_task_data, mix
from mrl.environments.arith import ArithEnvironment
from mrl.environments.base import EnvironmentStep
from mrl.environments.mixed import MixedEnvironment
from mrl.logging.metrics import MetricsLogger
from mrl.testing.fake_workers import FakeCheckpoints, FakeWorkers

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-cpu.yaml"
MIXED = (
    "~data.arith",
    "+envs={small: {kind: arith}, large: {kind: arith}}",
    "+data.sources=[{env: small, weight: 1, arith: {digits: 1, num_heldout: 4}},"
    " {env: large, weight: 3, arith: {digits: 2, num_heldout: 4}}]",
    "data.prompt_template=plain",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "eval.num_samples=1",
    "eval.pass_k=[1]",
    "checkpointing.save_every=50",
    "grpo.val_every=2",
    "grpo.max_num_steps=2",
)


def config(tmp_path: Path, *overrides: str):
    return load_config(RECIPE, [*MIXED, f"run.output_dir={tmp_path}", *overrides])


def refusal(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, *overrides)
    return caught.value


# ------------------------------------------------------------------------------------------------------ the config
def test_a_source_naming_an_unknown_environment_is_refused_with_the_names_allowed(tmp_path):
    error = str(refusal(tmp_path, "data.sources.1.env=larg"))
    assert "data.sources[1].env" in error and "'larg'" in error and "large, small" in error
    assert "data.sources[1].env=large" in error  # the nearest name, as the fix


def test_environments_without_sources_and_sources_without_environments_are_refused(tmp_path):
    assert "data.sources" in str(refusal(tmp_path, "data.sources=[]"))
    assert "`envs` defines none" in str(refusal(tmp_path, "envs={}"))


def test_weights_that_sum_to_nothing_are_refused(tmp_path):
    error = str(refusal(tmp_path, "data.sources.0.weight=0", "data.sources.1.weight=0"))
    assert "sum to 0" in error and "[0.0, 0.0]" in error
    assert "greater than or equal to 0" in str(refusal(tmp_path, "data.sources.0.weight=-1"))


def test_a_source_needs_one_kind_of_rows_and_the_single_source_keys_stay_out(tmp_path):
    assert "given: 'none'" in str(refusal(tmp_path, "~data.sources.0.arith"))
    assert "files and arith" in str(refusal(tmp_path, "+data.sources.0.train=x.jsonl"))
    assert "data.train and data.sources" in str(refusal(tmp_path, "data.train=x.jsonl"))


def test_an_unused_environment_and_a_server_without_its_section_are_refused(tmp_path):
    assert "envs.spare is named by no data source" in str(refusal(tmp_path, "+envs.spare={kind: arith}"))
    error = str(refusal(tmp_path, "envs.large.kind=server"))
    assert "envs.large.server" in error and "example: guess_number" in error
    error = str(refusal(tmp_path, "envs.large.kind=nemo_gym"))
    assert "envs.large.nemo_gym" in error and "server: workplace_assistant" in error
    with pytest.raises(ConfigError, match="env.nemo_gym") as single:
        load_config(RECIPE, [f"run.output_dir={tmp_path}", "env.kind=nemo_gym"])
    assert "NeMo Gym environment needs its nemo_gym section" in str(single.value)


# -------------------------------------------------------------------------------------------------------- the data
def _problems(tag: str, count: int) -> list[Problem]:
    return [Problem(f"{tag}{i}", "0", i) for i in range(count)]


def test_the_mix_gives_each_source_its_share_of_all_the_sources_rows():
    small, large = _problems("s", 4), _problems("l", 8)
    mixed = mix([small, large], [1, 3], seed=0)  # 12 rows: 1/4 -> 3 from small, 3/4 -> 9 from large
    assert len(mixed) == 12
    assert sum(p.problem.startswith("s") for p in mixed) == 3
    from_large = [p.problem for p in mixed if p.problem.startswith("l")]
    assert len(from_large) == 9 and len(set(from_large)) == 8  # all 8 once, then cycled: one twice
    assert mix([small, large], [1, 3], seed=0) == mixed  # the same list again (an exact resume rebuilds it)
    assert mix([small, large], [1, 0], seed=0) == mix([small], [1], seed=0)  # a weight of 0: validation only


def test_sources_load_tagged_with_their_environment_and_template(tmp_path):
    data = load_task_data(config(tmp_path))
    assert {p.env for p in data.train} == {"small", "large"}
    assert all((p.env, p.source) in {("small", 0), ("large", 1)} for p in data.train + data.val)
    assert [p.env for p in data.val] == ["small"] * 4 + ["large"] * 4  # every source's held-out rows, in order
    small = sum(p.env == "small" for p in data.train)
    assert small == round(len(data.train) / 4)  # weight 1 of 4
    assert all(len(p.problem) == 4 for p in data.train if p.env == "small")  # "3+5="
    assert [t.kind for t in data.templates] == ["plain", "plain"]


def _rows(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_naming_their_environment_are_read_and_a_bad_one_is_named(tmp_path):
    good = _rows(tmp_path, [{"problem": "1+1=", "answer": "2", "env": "small"}, {"problem": "10+10=", "answer": "20",
                                                                                   "env": "large"}])
    files = ("~data.sources.1.arith", "~data.sources.1.env", f"+data.sources.1.train={good}")
    data = load_task_data(config(tmp_path, *files))
    assert {(p.problem, p.env) for p in data.train if p.source == 1} == {("1+1=", "small"), ("10+10=", "large")}
    _rows(tmp_path, [{"problem": "1+1=", "answer": "2", "env": "smal"}])
    with pytest.raises(ConfigError, match=r"(?s)row 0 names the environment 'smal'.*large, small.*'small'"):
        load_task_data(config(tmp_path, *files))
    _rows(tmp_path, [{"problem": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"row 0 names no environment \(no column 'env'\)"):
        load_task_data(config(tmp_path, *files))


# ------------------------------------------------------------------------------------------------- the environment
class Constant:
    """An environment that gives every sample `reward` and records what it was asked."""

    def __init__(self, reward: float, errors: int = 0) -> None:
        self.reward, self.errors, self.asked = reward, errors, []

    def step(self, logs, metadata):
        self.asked.append([m["n"] for m in metadata])
        return EnvironmentStep(
            torch.full((len(logs),), self.reward), [{"role": "environment", "content": ""}] * len(logs),
            torch.ones(len(logs), dtype=torch.bool), [dict(m) for m in metadata], self.errors,
            ["boom"] * self.errors,
        )

    def shutdown(self):
        self.asked.append("shutdown")


def test_each_sample_is_scored_by_its_environment_and_put_back_in_place():
    a, b = Constant(1.0), Constant(0.25, errors=1)
    env = MixedEnvironment({"a": a, "b": b})
    meta = [{"env": name, "n": i} for i, name in enumerate("abba")]
    step = env.step([[{"role": "assistant", "content": ""}]] * 4, meta)
    assert a.asked == [[0, 3]] and b.asked == [[1, 2]]  # one call each, with its samples in batch order
    assert step.rewards.tolist() == [1.0, 0.25, 0.25, 1.0]
    assert [m["n"] for m in step.metadata] == [0, 1, 2, 3] and [m["env"] for m in step.metadata] == list("abba")
    assert step.num_errors == 1 and step.error_messages == ["b: boom"]
    with pytest.raises(KeyError, match="names environment 'c'"):
        env.step([[]], [{"env": "c"}])
    env.shutdown()
    assert a.asked[-1] == b.asked[-1] == "shutdown"


def test_per_environment_metrics_by_hand():
    rollouts = Rollouts(
        input_ids=torch.zeros(6, 1, dtype=torch.long), loss_mask=torch.zeros(6, 1),
        generation_logprobs=torch.zeros(6, 1), rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
        response_lengths=torch.tensor([2, 4, 6, 8, 10, 12]), truncated=torch.tensor([0, 0, 0, 0, 0, 1]).bool(),
        envs=["a", "a", "b", "b", "b", "b"], reward_errored=[False, False, False, False, True, False],
    )
    m = per_env_metrics("train", rollouts, group_size=2)
    assert m["train/env/a/reward"] == 0.5 and m["train/env/b/reward"] == 0.5
    assert m["train/env/a/response_length"] == 3.0 and m["train/env/b/response_length"] == 9.0
    assert m["train/env/b/truncated_fraction"] == 0.25 and m["train/env/b/reward_error_fraction"] == 0.25
    assert m["train/env/a/zero_variance_groups"] == 0.0 and m["train/env/b/zero_variance_groups"] == 1.0
    assert m["train/env/a/samples"] == 2.0
    assert per_env_metrics("val", rollouts, 2)["val/env/a/accuracy"] == 0.5
    assert per_env_metrics("train", Rollouts(**{**rollouts.__dict__, "envs": []}), 2) == {}


# ------------------------------------------------------------------------------------------------- a run with fakes
def small_right(step, prompt: str, k: int) -> str:
    a, b = prompt.rstrip("=").split("+")
    total = int(a) + int(b)
    return str(total) if len(a) == 1 and k == 0 else str(total + 1)


def test_a_grpo_run_logs_each_environments_reward_and_validation(tmp_path):
    cfg = config(tmp_path, "grpo.max_num_steps=4", "data.sources.1.weight=1")
    data = load_task_data(cfg)
    workers = FakeWorkers(cfg, small_right)
    env = MixedEnvironment({"small": ArithEnvironment(), "large": ArithEnvironment()})
    logger = MetricsLogger([])
    grpo_train(cfg, workers, env, data, logger, FakeCheckpoints(cfg, workers))
    logged = {name: dict(values) for name, values in logger.history.items()}
    for event in workers.events.of("generate"):  # each step: the environments of its prompts, and only those
        small = sum(len(prompt.split("+")[0]) == 1 for prompt in event.detail)
        counts = {"small": small, "large": len(event.detail) - small}
        for name, prompts in counts.items():
            assert logged[f"train/env/{name}/samples"].get(event.step, 0.0) == 2 * prompts
        assert logged["train/env/small/reward"].get(event.step, 0.5) == 0.5  # sample 0 of each 2 right
        assert logged["train/env/large/reward"].get(event.step, 0.0) == 0.0
    assert logged["train/env/small/samples"] and logged["train/env/large/samples"]  # both drawn in the run
    validations = sorted(logged["val/accuracy"])
    assert len(validations) >= 2 and logged["val/env/small/accuracy"] == dict.fromkeys(validations, 1.0)  # sample 0
    assert logged["val/env/large/accuracy"] == dict.fromkeys(validations, 0.0)
    assert logged["val/accuracy"] == dict.fromkeys(validations, 0.5)  # 4 small right, 4 large wrong


def test_the_summary_holds_each_environments_figures():
    from mrl.app.commands import _grpo_summary

    history = {
        "train/reward": [(1, 0.2), (2, 0.4)],
        "train/env/a/reward": [(1, 0.0), (2, 0.5)],  # both steps drew `a`
        "train/env/b/reward": [(2, 0.3)],  # only step 2 drew `b`
        "val/accuracy": [(0, 0.1), (2, 0.6)],
        "val/env/a/accuracy": [(0, 0.2), (2, 0.9)],
        "val/env/b/accuracy": [(0, 0.0), (2, 0.3)],
        "train/env/turns": [(1, 2.0)],  # a server's own figure: no environment of that name
    }
    final = {"val/accuracy": 0.6, "val/env/a/accuracy": 0.9, "val/env/b/accuracy": 0.3}
    envs = _grpo_summary(history, final, 1.0)["env"]
    assert envs == {
        "a": {"reward_first10": 0.25, "reward_last10": 0.25, "val_accuracy_before": 0.2, "val_accuracy_after": 0.9},
        "b": {"reward_first10": 0.3, "reward_last10": 0.3, "val_accuracy_before": 0.0, "val_accuracy_after": 0.3},
    }
    assert "env" not in _grpo_summary({"train/reward": [(1, 0.2)]}, {}, 1.0)


# ------------------------------------------------------------------------------------ a resource server in the mix
def test_a_resource_servers_episodes_join_the_single_turn_samples(tmp_path):
    """Arithmetic (sample 0 of each group right) beside mrl's guess-number server over real HTTP, every secret 2 and
    every guess "2": each episode finds it in one turn and its /verify gives 1."""
    from mrl.environments.registry import build_run_environment
    from mrl.environments.servers.examples import GuessNumber

    rows = [dict(row, secret=2, answer="2") for row in GuessNumber.rows(16, high=4)]
    games = tmp_path / "games.jsonl"
    games.write_text("".join(json.dumps(row) + "\n" for row in rows))
    server = "{example: guess_number, tool_format: bare, tool: guess, argument: number, max_turns: 3}"
    cfg = config(
        tmp_path,
        "data.sources.1.env=guess",
        "~data.sources.1.arith",
        f"+data.sources.1.train={games}",
        f"+data.sources.1.val={games}",
        "data.sources.1.weight=1",
        "data.instruction=''",
        f"+envs.guess={{kind: server, server: {server}}}",
        "~envs.large",
        "grpo.max_num_steps=3",
        "eval.max_problems=20",
    )

    def respond(step, prompt: str, k: int) -> str:
        return small_right(step, prompt, k) if "+" in prompt else "2"

    data = load_task_data(cfg)
    workers = FakeWorkers(cfg, respond)
    env = build_run_environment(cfg)
    logger = MetricsLogger([])
    try:
        grpo_train(cfg, workers, env, data, logger, FakeCheckpoints(cfg, workers))
    finally:
        env.shutdown()
    logged = {name: dict(values) for name, values in logger.history.items()}
    assert set(logged["train/env/guess/reward"].values()) == {1.0}  # found at the first guess
    assert set(logged["train/env/guess/turns"].values()) == {1.0}  # the server's own figure, under its name
    assert set(logged["train/env/small/reward"].values()) == {0.5}
    for step, small in logged["train/env/small/samples"].items():  # 4 prompts x 2 samples a step, both kinds
        assert small + logged["train/env/guess/samples"].get(step, 0.0) == 8
    assert logged["train/env/guess/samples"] and logged["train/env/small/samples"]
    validations = sorted(logged["val/accuracy"])
    assert logged["val/env/guess/accuracy"] == dict.fromkeys(validations, 1.0)
    assert logged["val/env/small/accuracy"] == dict.fromkeys(validations, 1.0)
    episodes, singles = logged["val/env/guess/samples"], logged["val/env/small/samples"]
    assert logged["val/accuracy"] == dict.fromkeys(validations, 1.0)
    assert all(episodes[s] == 16 and singles[s] == 4 for s in validations)  # every game, every held-out sum


def test_a_servers_failed_episodes_count_as_its_reward_errors():
    """An episode the server failed (seed_session, a tool call or verify) is a reward error of the server's
    environment, as a verifier's failure is of a single-turn one."""
    from mrl.algorithms.agent import Episode, rollouts_from_episodes

    episodes = [Episode({}, [1, 2], 2), Episode({}, [1, 2, 3], 2, server_error="verify: 500")]
    rollouts = rollouts_from_episodes(episodes, pad_id=0)
    assert rollouts.reward_errored == [False, True] and rollouts.num_reward_errors == 1
    rollouts.envs = ["guess", "guess"]
    assert per_env_metrics("train", rollouts, group_size=2)["train/env/guess/reward_error_fraction"] == 0.5
