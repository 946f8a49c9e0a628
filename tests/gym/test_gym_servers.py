"""mrl's agent loop and client against real NeMo Gym servers (nemo-gym 0.4.0, from its own Python 3.12 environment).

The expectations are NeMo Gym's own: workplace_assistant's /verify replays the episode's function calls on a fresh
environment and compares the resulting tables with those of the row's ground-truth calls (1.0 equal, else 0.0);
math_with_judge's compares the answer with the row's expected_answer by math-verify. The model is a scripted engine
(the tokens of a chosen text per turn), so what is tested is the loop and the formats, not a model's skill."""

from __future__ import annotations

import json
import os
import signal

import pytest

from mrl.algorithms.agent import AgentLimits, AgentRunner, ToolFormat, episode_metrics, problem_rows
from mrl.config.errors import ConfigError
from mrl.data.datasets import Problem, load_problems
from mrl.data.templates import PromptTemplate
from mrl.environments.nemo_gym.client import NemoGymClient
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput, SamplingConfig
from mrl.testing.gym import example_rows, require_gym

require_gym()
pytestmark = pytest.mark.timeout(300)


class ScriptedEngine:
    """A `GenerationBackend` whose every turn is `respond(prompt text, round)`'s text and the turn's end token;
    `before(round)` runs before a round (to kill a server mid-episode)."""

    def __init__(self, tokenizer, respond, before=None):
        self.tokenizer, self.respond, self.before, self.round = tokenizer, respond, before, 0
        self.end = PromptTemplate("chat").turn_end_id(tokenizer)

    def prepare_for_generation(self) -> None:
        pass

    def generate(self, prompts, sampling):
        if self.before is not None:
            self.before(self.round)
        samples = []
        for i, prompt in enumerate(prompts):
            text = self.respond(self.tokenizer.decode(list(prompt)), self.round)
            ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.end]
            samples.append(GeneratedSample(i, 0, list(prompt), ids, [-0.5] * len(ids), FinishReason.STOP))
        self.round += 1
        return GenerationOutput(samples, len(prompts), 1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from mrl.data.tokenizers import build_tokenizer

    return PreTrainedTokenizerFast.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def play(url, tokenizer, problems, respond, *, n=1, before=None, max_turns=4):
    """Episodes of `problems` (n each) against the server at `url`, as a run plays them; (episodes, runner)."""
    template = PromptTemplate("chat")
    prompts = [template.encode_messages(*_messages(p), p.problem, tokenizer) for p in problems]
    runner = AgentRunner(
        url, tokenizer, template, ToolFormat("json"), AgentLimits(max_turns, 512, 8192, 20.0, False), NemoGymClient
    )
    engine = ScriptedEngine(tokenizer, respond, before)
    rows = problem_rows(problems, NemoGymClient)
    return runner.run(engine, rows, prompts, SamplingConfig(n=n, max_new_tokens=512)), runner


def _messages(problem):
    from mrl.data import nemo_gym

    if nemo_gym.is_row(problem.fields):
        return nemo_gym.input_messages(problem.fields), nemo_gym.chat_tools(problem.fields)
    return [{"role": "user", "content": problem.problem}], None


def _calls_of(row) -> str:
    return "".join(
        f'<tool_call>{{"name": "{c["name"]}", "arguments": {c["arguments"]}}}</tool_call>' for c in row["ground_truth"][:1]
    )


def test_a_servers_example_rows_are_read_as_problems_by_their_nemo_gym_path():
    problems = load_problems("nemo-gym:workplace_assistant/example.jsonl").problems
    rows = example_rows("workplace_assistant")
    assert len(problems) == len(rows) == 5
    user = rows[0]["responses_create_params"]["input"][-1]["content"]
    assert user in problems[0].problem and problems[0].fields == rows[0]
    with pytest.raises(ConfigError, match="no resource server 'workplace_assistent'") as wrong:
        load_problems("nemo-gym:workplace_assistent/example.jsonl", key="data.sources[0].train")
    assert wrong.value.fix == "nemo-gym:workplace_assistant/example.jsonl" and wrong.value.key == "data.sources[0].train"
    with pytest.raises(ConfigError, match="ships no data file 'train.jsonl'") as missing:
        load_problems("nemo-gym:workplace_assistant/train.jsonl")
    assert missing.value.allowed == "example.jsonl, example_rollouts.jsonl"


def test_workplace_assistant_scores_the_ground_truth_call_1_and_a_bare_answer_0(servers, tokenizer):
    rows = example_rows("workplace_assistant")
    problems = load_problems("nemo-gym:workplace_assistant/example.jsonl").problems
    by_request = {p.problem: p.fields for p in problems}

    def respond(prompt: str, round: int) -> str:
        row = next(r for text, r in by_request.items() if text.splitlines()[-1] in prompt)
        right = row is rows[0] or row is by_request[problems[0].problem]
        if round == 0 and right:
            return _calls_of(row)  # the first row: its ground-truth call, then a final message
        return "Done."  # the others: an answer without any call

    episodes, runner = play(servers["workplace_assistant"].url, tokenizer, problems[:2], respond)
    solved, bare = episodes
    assert [e.reward for e in episodes] == [1.0, 0.0] and not any(e.server_error for e in episodes)
    assert solved.turns == 2 and solved.tool_calls == 1 and bare.turns == 1 and bare.tool_calls == 0
    kinds = [item["type"] for item in solved.transcript]
    assert kinds == ["function_call", "function_call_output", "message"]
    assert "replied successfully" in solved.transcript[1]["output"]  # the server's own answer, what the model read
    observation = tokenizer.decode(solved.ids[solved.prompt_length :])
    assert "replied successfully" in observation and "<|im_start|>tool" in observation
    assert runner.aggregate(episodes)["mean/reward"] == 0.5  # NeMo Gym's own aggregate over the two


def test_math_with_judge_verifies_the_final_message_and_takes_mrls_own_problems(servers, tokenizer):
    rows = example_rows("math_with_judge")
    own = Problem("What is 17 + 25?", "42", 0, {"problem": "What is 17 + 25?", "answer": "42"})
    problems = [*load_problems("nemo-gym:math_with_judge/example.jsonl").problems[:1], own]
    answers = {rows[0]["question"]: rows[0]["expected_answer"], "17 + 25": "42"}

    def respond(prompt: str, round: int) -> str:
        gold = next(a for q, a in answers.items() if q[:40] in prompt)
        return f"The answer is \\boxed{{{gold}}}."

    episodes, runner = play(servers["math_with_judge"].url, tokenizer, problems, respond, n=2)
    assert [e.reward for e in episodes] == [1.0, 1.0, 1.0, 1.0]
    assert episodes[2].verified["extracted_answer"] == "42"  # the server's own field, kept as a component
    wrong, _ = play(servers["math_with_judge"].url, tokenizer, [own], lambda p, r: "\\boxed{41}")
    assert wrong[0].reward == 0.0 and wrong[0].server_error is None
    figures = runner.aggregate(episodes)
    assert figures["mean/reward"] == 1.0


def test_a_tool_the_server_lacks_is_an_observation_for_the_model_not_a_server_error(servers, tokenizer):
    own = Problem("What is 2 + 2?", "4", 0, {})
    call = '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
    episodes, _ = play(servers["math_with_judge"].url, tokenizer, [own], lambda p, r: call if r == 0 else "\\boxed{4}")
    (episode,) = episodes
    assert episode.server_error is None and episode.tool_errors == 1 and episode.reward == 1.0
    assert "HTTP 404" in tokenizer.decode(episode.ids[episode.prompt_length :])


def test_a_server_killed_mid_episode_costs_those_episodes_named_and_counted(tokenizer):
    from mrl.environments.nemo_gym.process import GymServerProcess

    server = GymServerProcess("workplace_assistant", "doomed", {}, start_timeout_s=120, key="envs.doomed.nemo_gym")
    try:
        problems = load_problems("nemo-gym:workplace_assistant/example.jsonl").problems[:2]

        def kill_after_first_round(round: int) -> None:
            if round == 1:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()

        respond = lambda prompt, round: _calls_of(problems[0].fields)  # noqa: E731: a call every turn
        episodes, _ = play(server.url, tokenizer, problems, respond, n=2, before=kill_after_first_round)
    finally:
        server.stop()
    assert all(e.reward == 0.0 and e.verified is None for e in episodes)
    assert all("tool call 'email_reply_email'" in e.server_error and "ConnectError" in e.server_error for e in episodes)
    assert all(e.turns == 2 for e in episodes)  # the first round's calls were answered, the second's were not
    assert episode_metrics(episodes)["train/env_server_errors"] == 4.0


def test_servers_that_cannot_start_or_are_down_are_configuration_errors_naming_them():
    from mrl.environments.nemo_gym.environment import NemoGymEnvironment
    from mrl.environments.nemo_gym.process import GymServerProcess
    from mrl.parallel.ports import free_port

    with pytest.raises(ConfigError, match="exited with status") as unknown:
        GymServerProcess("no_such_server", "x", {}, start_timeout_s=60, key="envs.x.nemo_gym")
    assert unknown.value.key == "envs.x.nemo_gym.server" and "No module named" in str(unknown.value)
    with pytest.raises(ConfigError, match="exited with status") as bad_config:
        GymServerProcess("math_with_judge", "x", {"should_use_judge": "perhaps"}, start_timeout_s=60, key="envs.x.nemo_gym")
    assert "should_use_judge" in str(bad_config.value)

    class Down:
        url = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(ConfigError, match="does not answer GET") as down:
        NemoGymEnvironment(Down(), key="envs.tools.nemo_gym")
    assert down.value.key == "envs.tools.nemo_gym.url" and down.value.given == Down.url
    json.dumps(str(down.value))  # printable
