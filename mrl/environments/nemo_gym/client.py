"""The resource-server client (mrl/environments/servers/client.py) in NeMo Gym's dialect of the protocol.

    POST /seed_session      <the dataset row itself>            -> {} and a signed session cookie
                                                                   (`<ServerClass>___<name>`; the whole session)
    POST /<tool>            <the call's arguments>              -> any text: what the model reads
    POST /verify            {<row fields>, "response": <an OpenAI Responses object whose `output` is the episode
                             after the prompt: function_call, function_call_output and message items, in order>}
                                                                -> {<row fields>, "reward": float, <the server's>}
    POST /aggregate_metrics {"verify_responses": [{<verify answer>, "_ng_task_index", "_ng_rollout_index"}, ...]}
                                                                -> {"agent_metrics": {...}, "key_metrics": {...}, ...}
    GET  /                                                      -> {"status": "ok"} (liveness)

A problem that is no NeMo Gym row (mrl's own data sources) is made one (`row_of`). (nemo-gym 0.4.0:
nemo_gym/base_resources_server.py, server_utils.py; the reference agent
responses_api_agents/simple_agent/app.py.) Each episode keeps the cookie its seed got and sends it on every later
call. Failures count as in the base client: nothing listening "down", no answer "timeout", not JSON where JSON is due
or a seed without a cookie "malformed", a 5xx "http_5xx". A tool's 4xx is the model's mistake (bad arguments, an
unknown tool): its text is the observation, as NeMo Gym's agent shows it, with error_kind "tool".
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from numbers import Real
from typing import Any, Sequence

import httpx

from mrl.data import nemo_gym
from mrl.environments.servers.client import (
    AsyncResourceClient,
    SessionHandle,
    ToolResult,
    VerifyResult,
    _detail,
    _payload,
    _Plan,
    _require_dict,
    _ServerProblem,
)
from mrl.environments.servers.protocol import REWARD, SEED_SESSION

#: Keys of a verify answer that echo the request, not the server's judgement.
_ECHOED = frozenset({REWARD, "response", "responses_create_params"})


class NemoGymClient(AsyncResourceClient):
    """`AsyncResourceClient` speaking to a NeMo Gym resource server (see the module docstring)."""

    def _session_headers(self, session_id: str) -> dict[str, str]:
        return {"Cookie": session_id}

    def _seed_plan(self, row: dict) -> _Plan[SessionHandle]:
        _require_dict("row", row)
        return _Plan(
            "POST",
            f"/{SEED_SESSION}",
            row,
            None,
            _unused,
            lambda message, kind: SessionHandle("", None, message, kind),
            read=_read_seed,
        )

    def _tool_plan(self, session: SessionHandle, name: str, arguments: dict | None) -> _Plan[ToolResult] | ToolResult:
        plan = super()._tool_plan(session, name, arguments)
        return replace(plan, read=_read_tool) if isinstance(plan, _Plan) else plan

    @staticmethod
    def _verify_body(row: dict, response: dict) -> dict:
        return {**row, "response": response}

    @staticmethod
    def _verify_result(payload: Any, row: dict) -> VerifyResult:
        return _parse_verify(payload, row)

    @staticmethod
    def _metrics_body(results: list[dict]) -> dict:
        return {"verify_responses": results}

    @staticmethod
    def _metrics_result(payload: Any) -> dict:
        return _parse_metrics(payload)

    @staticmethod
    def row_of(problem: str, answer: str, fields: dict) -> dict:
        """A NeMo Gym row as it is; any other problem (a file of problem/answer rows, the arithmetic task,
        reasoning-gym) as one: its problem as the request's input and as `question`, its gold answer as
        `expected_answer` (what NeMo Gym's math verifiers read), and its own fields."""
        if nemo_gym.is_row(fields):
            return dict(fields)
        request = {"input": [{"role": "user", "content": problem}]}
        return {**fields, nemo_gym.ROW_KEY: request, "question": problem, "expected_answer": answer}

    @staticmethod
    def response_body(last_text: str, turns: int, transcript: Sequence[dict]) -> dict:
        """What /verify reads as `response`: an OpenAI Responses object holding the episode's items."""
        return {
            "id": "mrl-episode",
            "created_at": 0,
            "model": "policy",
            "object": "response",
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "output": list(transcript),
        }

    @staticmethod
    def metric_row(verified: dict, task: int, sample: int) -> dict:
        """A verify result as /aggregate_metrics takes it: with its task (row) and rollout (sample) index."""
        return {**verified, "_ng_task_index": task, "_ng_rollout_index": sample}


def _unused(payload: Any) -> Any:
    raise AssertionError("read replaces parse")


def _read_seed(response: httpx.Response) -> SessionHandle:
    payload = _payload(response)
    if not isinstance(payload, dict):
        raise _ServerProblem("malformed", f"the seed answer is a JSON {type(payload).__name__}, not an object")
    cookie = "; ".join(f"{name}={value}" for name, value in response.cookies.items())
    if not cookie:
        raise _ServerProblem("malformed", "the seed answer set no session cookie")
    return SessionHandle(cookie, None)


def _read_tool(response: httpx.Response) -> ToolResult:
    if response.status_code >= 500 or response.status_code < 200:
        raise _ServerProblem(f"http_{response.status_code}", _detail(response))
    if response.is_success:
        return ToolResult(response.text)
    return ToolResult(response.text, f"HTTP {response.status_code}: {response.text[:500]}", "tool")


def _parse_verify(payload: Any, row: dict) -> VerifyResult:
    if not isinstance(payload, dict) or REWARD not in payload:
        raise _ServerProblem("malformed", f"no {REWARD!r} in the verify answer {json.dumps(payload)[:200]}")
    reward = payload[REWARD]
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise _ServerProblem("malformed", f"reward {reward!r} is no finite number")
    components = {
        key: value
        for key, value in payload.items()
        if key not in row and key not in _ECHOED and (value is None or isinstance(value, (str, int, float, bool)))
    }
    return VerifyResult(float(reward), components)


def _parse_metrics(payload: Any) -> dict:
    """The numbers of the answer's `agent_metrics` and `key_metrics` (both keyed like "mean/reward")."""
    if not isinstance(payload, dict):
        raise _ServerProblem("malformed", f"metrics are a JSON {type(payload).__name__}, not an object")
    flat: dict[str, float] = {}
    for part in ("agent_metrics", "key_metrics"):
        for key, value in (payload.get(part) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[key] = float(value)
    return flat
