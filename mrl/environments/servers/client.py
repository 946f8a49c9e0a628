"""Clients of a resource server (resource.py), sync and async, that never raise because of the server.

    seed_session(row) -> SessionHandle -> call_tool(handle, name, arguments) -> ToolResult (as often as needed)
                                       -> verify(handle, row, response) -> VerifyResult(reward, components)
    tools() -> [ToolSpec];  aggregate_metrics(results) -> {metric: value}

An agent loop runs many episodes against servers that may be down, slow or wrong, and one bad episode must not end
the run: every server problem becomes a result with `error` and `error_kind` set (a failed verify scores 0.0;
tools() answers [] and aggregate_metrics {}) and is counted in `client.errors` under that kind:
    "down"           nothing listening, or the connection was lost
    "timeout"        no answer within timeout_s (per connect / read / write / wait for a pooled connection)
    "malformed"      not JSON, or JSON of the wrong shape (e.g. a verify answer without "reward")
    "http_<status>"  any non-2xx answer: http_422 for arguments the tool does not take, http_404 for an unknown
                     tool or a session the server no longer has, http_500 for a bug in the server
`last_error` holds the newest message, with the URL. A tool's own error (it raised; error_kind "tool") is an
observation for the model, not a server problem, and is not counted. With error_kind an agent loop can tell an
episode the infrastructure spoilt (down, timeout, malformed, http_5xx) from one the model got wrong.
A handle whose seed failed can still be passed on: its calls fail at once, without a request, and are not counted
again. Mistakes in the calling code (a session that is not a SessionHandle, arguments that are not a dict) raise
TypeError.

Environment proxy variables are ignored (trust_env=False): resource servers are on loopback or the cluster network.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import httpx

from mrl.environments.servers.protocol import (
    AGGREGATE_METRICS,
    DONE,
    REWARD,
    REWARD_COMPONENTS,
    SEED_SESSION,
    SESSION_HEADER,
    TOOLS,
    VERIFY,
    ToolSpec,
    is_tool_name,
)

R = TypeVar("R")


@dataclass(frozen=True)
class SessionHandle:
    session_id: str  # "" when the seed failed
    observation: str | None = None
    error: str | None = None  # why the session could not be created
    error_kind: str | None = None  # the errors key it was counted under ("down", "http_422", ...)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ToolResult:
    output: str | None  # a tool's dict output arrives as its JSON text: what the model reads
    error: str | None = None  # the tool's own error (what the model did wrong), or a server problem
    error_kind: str | None = None  # "tool" (the tool raised), "http_422" (bad arguments), "down", "timeout", ...
    done: bool = False  # the server says the episode is over


@dataclass(frozen=True)
class VerifyResult:
    reward: float  # 0.0 when error is set
    components: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None  # set with error: a failed verify is no judgement of the response


class _ServerProblem(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class _Plan(Generic[R]):
    """One request and how to read its answer; `fallback(message, kind)` is the result when it fails."""

    method: str
    path: str
    body: dict | None
    session_id: str | None
    parse: Callable[[Any], R]
    fallback: Callable[[str, str], R]  # (message, kind) -> the result of a failed call
    read: Optional[Callable[[httpx.Response], R]] = None  # reads the whole answer (status, cookies) instead of parse


class _Core:
    """What the sync and async clients share: building requests, reading answers, counting failures."""

    def __init__(self, base_url: str, timeout_s: float):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} is no URL: pass e.g. 'http://127.0.0.1:8000'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.errors: Counter[str] = Counter()
        self.last_error: str | None = None
        self._count_lock = threading.Lock()  # the sync client may be shared by threads

    def _seed_plan(self, row: dict) -> _Plan[SessionHandle]:
        _require_dict("row", row)
        return _Plan(
            "POST",
            f"/{SEED_SESSION}",
            {"row": row},
            None,
            _parse_seed,
            lambda message, kind: SessionHandle("", None, message, kind),
        )

    def _tool_plan(self, session: SessionHandle, name: str, arguments: dict | None) -> _Plan[ToolResult] | ToolResult:
        _require_handle(session)
        arguments = {} if arguments is None else _require_dict("arguments", arguments)
        if not isinstance(name, str):
            raise TypeError(f"the tool name must be a str, got {type(name).__name__}")
        if not session.ok:
            return ToolResult(None, f"no session: {session.error}", session.error_kind)
        if not is_tool_name(name):  # a model may name anything; never let it reach /verify or /seed_session
            return ToolResult(None, f"unknown tool {name!r}", "unknown_tool")
        return _Plan(
            "POST",
            f"/{name}",
            arguments,
            session.session_id,
            _parse_tool,
            lambda message, kind: ToolResult(None, message, kind),
        )

    def _verify_plan(self, session: SessionHandle, row: dict, response: dict) -> _Plan[VerifyResult] | VerifyResult:
        _require_handle(session)
        _require_dict("row", row)
        _require_dict("response", response)
        if not session.ok:
            return VerifyResult(0.0, {}, f"no session: {session.error}", session.error_kind)
        return _Plan(
            "POST",
            f"/{VERIFY}",
            self._verify_body(row, response),
            session.session_id,
            lambda payload: self._verify_result(payload, row),
            lambda message, kind: VerifyResult(0.0, {}, message, kind),
        )

    @staticmethod
    def _verify_body(row: dict, response: dict) -> dict:
        return {"row": row, "response": response}

    @staticmethod
    def _verify_result(payload: Any, row: dict) -> VerifyResult:
        return _parse_verify(payload, row)

    def _tools_plan(self) -> _Plan[list[ToolSpec]]:
        return _Plan("GET", f"/{TOOLS}", None, None, _parse_tools, lambda message, kind: [])

    def _metrics_plan(self, results: list[dict]) -> _Plan[dict]:
        if not isinstance(results, list):
            raise TypeError(f"results must be a list of verify results (dicts), got {type(results).__name__}")
        return _Plan(
            "POST", f"/{AGGREGATE_METRICS}", self._metrics_body(results), None, self._metrics_result, lambda m, k: {}
        )

    @staticmethod
    def _metrics_body(results: list[dict]) -> dict:
        return {"results": results}

    @staticmethod
    def _metrics_result(payload: Any) -> dict:
        return _parse_metrics(payload)

    def _session_headers(self, session_id: str) -> dict[str, str]:
        """The headers that name a session on a request (a dialect of the protocol may name it otherwise)."""
        return {SESSION_HEADER: session_id}

    def _request_args(self, plan: _Plan) -> dict:
        headers = self._session_headers(plan.session_id) if plan.session_id else {}
        return {"method": plan.method, "url": plan.path, "json": plan.body, "headers": headers}

    def _finish(self, plan: _Plan[R], response: httpx.Response | None, exc: httpx.HTTPError | None) -> R:
        try:
            if exc is not None:
                raise _transport_problem(exc)
            assert response is not None
            return plan.read(response) if plan.read is not None else plan.parse(_payload(response))
        except _ServerProblem as problem:
            with self._count_lock:
                self.errors[problem.kind] += 1
                self.last_error = f"{problem.kind}: {plan.method} {self.base_url}{plan.path}: {problem}"
            return plan.fallback(str(problem), problem.kind)


class ResourceClient(_Core):
    """Blocking client (thread-safe; one connection pool). Use as a context manager or call close()."""

    def __init__(self, base_url: str, *, timeout_s: float = 10.0):
        super().__init__(base_url, timeout_s)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    def seed_session(self, row: dict) -> SessionHandle:
        return self._run(self._seed_plan(row))

    def call_tool(self, session: SessionHandle, name: str, arguments: dict | None = None) -> ToolResult:
        plan = self._tool_plan(session, name, arguments)
        return self._run(plan) if isinstance(plan, _Plan) else plan

    def verify(self, session: SessionHandle, row: dict, response: dict) -> VerifyResult:
        plan = self._verify_plan(session, row, response)
        return self._run(plan) if isinstance(plan, _Plan) else plan

    def tools(self) -> list[ToolSpec]:
        return self._run(self._tools_plan())

    def aggregate_metrics(self, results: list[dict]) -> dict:
        return self._run(self._metrics_plan(results))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ResourceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: _Plan[R]) -> R:
        try:
            return self._finish(plan, self._http.request(**self._request_args(plan)), None)
        except httpx.HTTPError as exc:
            return self._finish(plan, None, exc)


class AsyncResourceClient(_Core):
    """The same methods as coroutines, for an agent loop running many sessions at once on one event loop.

    max_connections bounds the requests in flight to this server (more wait for a free connection, which counts
    against timeout_s as a pool timeout).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 10.0, max_connections: int = 100):
        super().__init__(base_url, timeout_s)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def seed_session(self, row: dict) -> SessionHandle:
        return await self._run(self._seed_plan(row))

    async def call_tool(self, session: SessionHandle, name: str, arguments: dict | None = None) -> ToolResult:
        plan = self._tool_plan(session, name, arguments)
        return await self._run(plan) if isinstance(plan, _Plan) else plan

    async def verify(self, session: SessionHandle, row: dict, response: dict) -> VerifyResult:
        plan = self._verify_plan(session, row, response)
        return await self._run(plan) if isinstance(plan, _Plan) else plan

    async def tools(self) -> list[ToolSpec]:
        return await self._run(self._tools_plan())

    async def aggregate_metrics(self, results: list[dict]) -> dict:
        return await self._run(self._metrics_plan(results))

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def row_of(problem: str, answer: str, fields: dict) -> dict:
        """The row a session is seeded with and verified against (mrl's servers: the problem's whole source row)."""
        return dict(fields)

    @staticmethod
    def response_body(last_text: str, turns: int, transcript: Sequence[dict]) -> dict:
        """What /verify reads as `response` of an episode (mrl's servers: the last turn's text and the turns)."""
        return {"text": last_text, "turns": turns}

    @staticmethod
    def metric_row(verified: dict, task: int, sample: int) -> dict:
        """A verify result as /aggregate_metrics takes it (mrl's servers: as it is)."""
        return verified

    async def __aenter__(self) -> AsyncResourceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, plan: _Plan[R]) -> R:
        try:
            return self._finish(plan, await self._http.request(**self._request_args(plan)), None)
        except httpx.HTTPError as exc:
            return self._finish(plan, None, exc)


def _transport_problem(exc: httpx.HTTPError) -> _ServerProblem:
    if isinstance(exc, httpx.TimeoutException):  # before ConnectError's family: ConnectTimeout is a timeout
        return _ServerProblem("timeout", f"no answer within the client's timeout_s ({type(exc).__name__})")
    if isinstance(exc, httpx.RemoteProtocolError):
        return _ServerProblem("malformed", f"not HTTP: {exc}")
    return _ServerProblem("down", f"{type(exc).__name__}: {exc or 'the server cannot be reached'}")


def _payload(response: httpx.Response) -> Any:
    """The JSON of a 2xx answer; any other status is an http_<status> problem carrying the server's detail."""
    if not response.is_success:
        raise _ServerProblem(f"http_{response.status_code}", _detail(response))
    try:
        return response.json()
    except ValueError:
        raise _ServerProblem("malformed", f"the answer is not JSON: {response.text[:200]!r}") from None


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if detail is None:
        return response.text[:500] or response.reason_phrase
    return detail if isinstance(detail, str) else json.dumps(detail)[:500]


def _parse_seed(payload: Any) -> SessionHandle:
    session_id = _field(payload, "session_id", str)
    observation = _field(payload, "observation", (str, type(None)), default=None)
    if not session_id:
        raise _ServerProblem("malformed", "empty session_id")
    return SessionHandle(session_id, observation)


def _parse_tool(payload: Any) -> ToolResult:
    output = _field(payload, "output", (str, dict, type(None)))
    error = _field(payload, "error", (str, type(None)), default=None)
    done = _field(payload, DONE, bool, default=False)
    if isinstance(output, dict):
        output = json.dumps(output)
    return ToolResult(output, error, "tool" if error is not None else None, done)


def _parse_verify(payload: Any, row: dict) -> VerifyResult:
    reward = _field(payload, REWARD, Real)
    if isinstance(reward, bool) or not math.isfinite(reward):
        raise _ServerProblem("malformed", f"reward {reward!r} is no finite number")
    names = payload.get(REWARD_COMPONENTS)
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        names = [k for k in payload if k not in row and k != REWARD]  # a server without the names list
    return VerifyResult(float(reward), {n: payload[n] for n in names if n in payload and n != REWARD})


def _parse_tools(payload: Any) -> list[ToolSpec]:
    specs = []
    for item in _field(payload, "tools", list):
        try:
            specs.append(
                ToolSpec(
                    str(item["name"]),
                    tuple(item["parameters"]),
                    tuple(item.get("required", ())),
                    str(item.get("description", "")),
                )
            )
        except (TypeError, KeyError, AttributeError):
            raise _ServerProblem("malformed", f"a tool listing without name/parameters: {item!r:.200}") from None
    return specs


def _parse_metrics(payload: Any) -> dict:
    if not isinstance(payload, dict):
        raise _ServerProblem("malformed", f"metrics are a JSON {type(payload).__name__}, not an object")
    return payload


_MISSING = object()


def _field(payload: Any, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """payload[key], checked: a missing key (without a default) or a value of another type is a malformed answer."""
    if not isinstance(payload, dict):
        raise _ServerProblem("malformed", f"expected a JSON object with {key!r}, got a {type(payload).__name__}")
    value = payload.get(key, default)
    if value is _MISSING:
        raise _ServerProblem("malformed", f"no {key!r} in the answer {json.dumps(payload)[:200]}")
    if not isinstance(value, kind):
        raise _ServerProblem("malformed", f"{key!r} is {value!r:.100}, of the wrong type")
    return value


def _require_handle(session: Any) -> None:
    if not isinstance(session, SessionHandle):
        raise TypeError(f"session must be the SessionHandle seed_session returned, got {type(session).__name__}")


def _require_dict(what: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a dict (a JSON object), got {type(value).__name__}")
    return value
