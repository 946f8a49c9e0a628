"""NeMo Gym's formats on mrl's side, without NeMo Gym (tests/gym plays the real servers): its rows read as problems and
prompts, mrl's own problems made rows, an episode's turns as Responses items, which tool-call failures end an episode,
and the Python it needs looked for where it is said to be."""

from __future__ import annotations

import json

import pytest

from mrl.algorithms.agent import infrastructure_failure, transcript_item
from mrl.config.errors import ConfigError
from mrl.data import nemo_gym
from mrl.data.datasets import load_problems
from mrl.data.templates import PromptTemplate
from mrl.environments.nemo_gym.client import NemoGymClient, _parse_metrics
from mrl.environments.servers.client import AsyncResourceClient

pytestmark = pytest.mark.unit

TOOL = {"type": "function", "name": "email_send", "description": "Send an email.",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}}
ROW = {
    "id": 3,
    "responses_create_params": {
        "input": [{"role": "system", "content": "Today is Thursday."},
                  {"role": "user", "content": [{"type": "input_text", "text": "Email "}, {"type": "input_text", "text": "Ann."}]}],
        "tools": [TOOL],
    },
    "ground_truth": [{"name": "email_send", "arguments": "{\"to\": \"ann@x.com\"}"}],
}
TOOLS_TEMPLATE = (
    "{% if tools %}{{ 'tools: ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from mrl.data.tokenizers import build_tokenizer

    return PreTrainedTokenizerFast.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_a_nemo_gym_row_is_a_problem_whose_prompt_is_its_input(tmp_path):
    rows = tmp_path / "rows.jsonl"
    math_row = {"responses_create_params": {"input": "What is 6*7?"}, "expected_answer": "42"}
    empty = {"responses_create_params": {"input": [{"role": "user", "content": "  "}]}}
    rows.write_text("".join(json.dumps(r) + "\n" for r in (ROW, math_row, empty)))
    problems = load_problems(str(rows))
    first, second = problems.problems
    assert first.problem == "Today is Thursday.\n\nEmail Ann." and first.fields == ROW
    assert json.loads(first.answer) == ROW["ground_truth"]  # shown, never scored: the server scores
    assert (second.problem, second.answer) == ("What is 6*7?", "42")
    assert problems.skipped == {"empty responses_create_params.input": 1}


def test_chat_prompts_render_the_rows_messages_and_tools_and_plain_ones_its_text(tokenizer):
    messages, tools = nemo_gym.input_messages(ROW), nemo_gym.chat_tools(ROW)
    assert messages == [{"role": "system", "content": "Today is Thursday."}, {"role": "user", "content": "Email Ann."}]
    assert tools == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    tokenizer.chat_template = TOOLS_TEMPLATE
    ids = PromptTemplate("chat", "Think.").encode_messages(messages, tools, "unused", tokenizer)
    assert tokenizer.decode(ids) == (
        "tools: email_send \n<|im_start|>system\nToday is Thursday.<|im_end|>\n<|im_start|>user\nEmail Ann.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # no instruction: the row's messages are the whole prompt
    plain = PromptTemplate("plain", "Think.").encode_messages(messages, tools, "Email Ann.", tokenizer)
    assert plain == tokenizer("Email Ann.")["input_ids"]
    assert PromptTemplate("plain", "").encode_messages(messages, tools, "Email Ann.", tokenizer, max_length=3) is None


def test_mrls_own_problems_become_rows_nemo_gyms_verifiers_read_and_its_rows_stay_as_they_are():
    row = NemoGymClient.row_of("12+30=", "42", {"problem": "12+30=", "answer": "42"})
    assert row == {"problem": "12+30=", "answer": "42", "question": "12+30=", "expected_answer": "42",
                   "responses_create_params": {"input": [{"role": "user", "content": "12+30="}]}}
    assert NemoGymClient.row_of("ignored", "ignored", ROW) == ROW
    assert AsyncResourceClient.row_of("p", "a", {"secret": 3}) == {"secret": 3}  # mrl's servers: the source row


def test_an_episode_is_sent_to_verify_as_a_responses_object_of_its_items():
    call = transcript_item('<tool_call>{"name": "email_send"...', ("email_send", {"to": "ann@x.com"}), "call_1")
    final = transcript_item("Sent.", None, "call_2")
    assert call == {"type": "function_call", "call_id": "call_1", "name": "email_send", "arguments": '{"to": "ann@x.com"}'}
    assert final["type"] == "message" and final["content"][0] == {"type": "output_text", "text": "Sent.", "annotations": []}
    body = NemoGymClient.response_body("Sent.", 2, [call, final])
    # the fields openai 2.7.2's Response requires (NeMo Gym 0.4.0 validates /verify's `response` as one)
    assert {"id", "created_at", "model", "object", "output", "parallel_tool_calls", "tool_choice", "tools"} <= set(body)
    assert body["object"] == "response" and body["output"] == [call, final]
    assert AsyncResourceClient.response_body("Sent.", 2, [call]) == {"text": "Sent.", "turns": 2}
    assert NemoGymClient.metric_row({"reward": 1.0}, 3, 1) == {"reward": 1.0, "_ng_task_index": 3, "_ng_rollout_index": 1}


def test_only_the_servers_own_failures_end_an_episode():
    assert [infrastructure_failure(k) for k in ("down", "timeout", "malformed", "http_500", "http_503")] == [True] * 5
    assert [infrastructure_failure(k) for k in (None, "tool", "unknown_tool", "http_404", "http_422")] == [False] * 5


def test_aggregate_metrics_keep_the_numbers_of_nemo_gyms_answer():
    answer = {"group_level_metrics": [{"x": 1}], "agent_metrics": {"mean/reward": 0.5, "name": "x"},
              "key_metrics": {"pass@1": 0.25, "flag": True}}
    assert _parse_metrics(answer) == {"mean/reward": 0.5, "pass@1": 0.25}


def test_the_gym_python_is_looked_for_where_it_is_said_to_be_and_missing_it_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(nemo_gym.GYM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ConfigError, match="NeMo Gym's Python is not installed") as missing:
        nemo_gym.gym_python("envs.tools.nemo_gym")
    assert missing.value.key == "envs.tools.nemo_gym" and "make gym-venv" in missing.value.fix
    with pytest.raises(ConfigError):
        nemo_gym.resolve_path("nemo-gym:workplace_assistant/example.jsonl", "data.sources[0].train")
    assert nemo_gym.resolve_path("rows.jsonl", "data.train") == "rows.jsonl"  # any other path as it is
