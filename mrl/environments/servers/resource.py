"""Resource servers: an environment's tools, per-session state and verifier behind HTTP, in NeMo Gym's shape.

    row -> POST /seed_session -> seed_session(row) = state (kept here under a new session id) + observation
        -> POST /<tool> {arguments}, as often as the agent loop likes -> tool(state, **arguments) -> output | error
        -> POST /verify {row, response} -> verify(state, row, response) = {"reward": float, <components>}
    results of many verifies -> POST /aggregate_metrics -> aggregate_metrics(results)

Subclass ResourceServer and mark its tools with @tool; build_app(server) gives the FastAPI app, serve(server) runs it
under uvicorn in a background thread (tests, `mrl env serve`). The wire format is in protocol.py.

Failure contract: a tool that raises answers 200 with {"output": null, "error": message} (what the model sees, like
any observation); arguments the tool does not take, a row seed_session refuses (InputError) or a bad body answer 422
with the fix; an unknown session 404; anything else the server's own code raises, 500 with the exception.
Endpoints run the subclass's code in the thread pool, so a slow tool holds neither the event loop nor other sessions;
calls within one session run one at a time (a lock per session), since tools mutate its state.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import logging
import math
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mrl.environments.servers.protocol import (
    AGGREGATE_METRICS,
    DONE,
    HEALTH,
    REWARD,
    REWARD_COMPONENTS,
    SEED_SESSION,
    SESSION_COOKIE,
    SESSION_HEADER,
    TOOLS,
    VERIFY,
    ToolSpec,
    is_tool_name,
)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_TOOL_MARK = "__mrl_tool__"
DEFAULT_SESSION_TTL_S = 3600.0


class InputError(ValueError):
    """Raised by seed_session / verify when the row or response cannot be used: the server answers 422 with it."""


def tool(fn: F) -> F:
    """Mark a ResourceServer method `(self, state, **arguments) -> str | dict` as a tool, served at POST /<name>."""
    setattr(fn, _TOOL_MARK, True)
    return fn


class ResourceServer:
    """One environment: subclass it, set `name`, write seed_session, the @tool methods and verify.

    Server-side state lives in the dict seed_session returns; tools and verify receive that same dict and may mutate
    it. An instance serves every session, so keep per-episode data in `state`, never on `self`.
    """

    name: str = ""

    def seed_session(self, row: dict) -> dict:
        """The initial state of a session for one data row (raise InputError when the row is unusable)."""
        return {}

    def observation(self, state: dict, row: dict) -> str | None:
        """The first observation the model sees in a new session (None: the prompt comes from the row alone)."""
        return None

    def is_done(self, state: dict) -> bool:
        """Whether the episode is over after a tool call (sent as the call's "done"; the agent loop then stops it)."""
        return False

    def verify(self, state: dict, row: dict, response: dict) -> dict:
        """{"reward": float} plus optional reward components, from the session's state and the final response."""
        raise NotImplementedError(f"{type(self).__name__}.verify: write it, returning {{'reward': float, ...}}")

    def aggregate_metrics(self, results: list[dict]) -> dict:
        """Metrics over many verify results; by default the mean of every numeric key (booleans count as 0/1)."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for result in results:
            for key, value in result.items():
                if isinstance(value, Real) and math.isfinite(value):
                    sums[key] = sums.get(key, 0.0) + float(value)
                    counts[key] = counts.get(key, 0) + 1
        return {key: sums[key] / counts[key] for key in sums}


@dataclass(frozen=True)
class _Tool:
    spec: ToolSpec
    fn: Callable[..., Any]  # bound method: fn(state, **arguments)
    takes_any: bool  # the signature has **kwargs: any argument name is accepted


def tool_specs(server: ResourceServer) -> list[ToolSpec]:
    """What GET /tools lists: the server's tools with their argument names, in name order."""
    return [t.spec for t in _discover(server).values()]


def _discover(server: ResourceServer) -> dict[str, _Tool]:
    """The @tool methods of a server, checked: valid names that are no endpoint, arguments passable by name."""
    tools = {}
    for name in sorted(dir(type(server))):
        if not getattr(getattr(type(server), name, None), _TOOL_MARK, False):
            continue
        if not is_tool_name(name):
            raise ValueError(
                f"{type(server).__name__}.{name}: '{name}' is an endpoint of every resource server; rename the tool"
            )
        tools[name] = _describe(name, getattr(server, name))
    return tools


def _describe(name: str, fn: Callable[..., Any]) -> _Tool:
    params = list(inspect.signature(fn).parameters.values())  # bound method: `self` is gone
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, *by_name):
        raise TypeError(f"tool {name} must take (self, state, **arguments); its first argument receives the state")
    arguments, required, takes_any = [], [], False
    for p in params[1:]:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            takes_any = True
        elif p.kind in by_name:
            arguments.append(p.name)
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        else:
            raise TypeError(
                f"tool {name}: argument {p.name!r} ({p.kind.description}) cannot be passed by name from "
                "JSON; make it a plain or keyword-only argument"
            )
    doc = inspect.getdoc(fn) or ""
    return _Tool(ToolSpec(name, tuple(arguments), tuple(required), doc), fn, takes_any)


@dataclass
class Session:
    state: dict
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time: tools mutate `state`


class SessionStore:
    """Session id -> Session, shared by the endpoint threads; a session idle longer than ttl_s is dropped."""

    def __init__(self, ttl_s: float = DEFAULT_SESSION_TTL_S, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._last_purge = clock()

    def create(self, state: dict) -> str:
        session_id = secrets.token_urlsafe(16)
        now = self._clock()
        with self._lock:
            if now - self._last_purge >= min(self.ttl_s, 60.0):  # a full scan at most once a minute
                self._purge(now)
            self._sessions[session_id] = Session(state, now)
        return session_id

    def get(self, session_id: str) -> Session | None:
        """The live session (its idle clock restarted), or None when it never existed or expired."""
        now = self._clock()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and now - session.last_used > self.ttl_s:
                del self._sessions[session_id]
                session = None
            if session is not None:
                session.last_used = now
            return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _purge(self, now: float) -> None:
        expired = [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
        for sid in expired:
            del self._sessions[sid]
        self._last_purge = now


class _SeedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: dict[str, Any] = Field(default_factory=dict)


class _VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: dict[str, Any]
    response: dict[str, Any]


class _MetricsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    results: list[dict[str, Any]]


def build_app(server: ResourceServer, *, session_ttl_s: float = DEFAULT_SESSION_TTL_S) -> FastAPI:
    """The FastAPI app of a resource server: the framework endpoints, one POST route per tool, 404 for other tools."""
    if not server.name:
        raise ValueError(f'{type(server).__name__} has no name: set the class attribute `name = "..."`')
    tools = _discover(server)
    store = SessionStore(session_ttl_s)
    app = FastAPI(title=f"mrl resource server: {server.name}")
    app.state.sessions = store
    _add_framework_routes(app, server, store, tools)
    for t in tools.values():
        _add_tool_route(app, server, store, t)

    @app.post("/{name}")
    async def unknown_tool(name: str) -> None:  # registered last: the real tools' routes match first
        raise HTTPException(
            404,
            f"unknown tool {name!r}: {server.name}'s tools are {', '.join(tools) or 'none'} "
            f"(GET /{TOOLS} lists their arguments)",
        )

    return app


def _add_framework_routes(app: FastAPI, server: ResourceServer, store: SessionStore, tools: dict[str, _Tool]) -> None:
    cls = type(server).__name__

    @app.post(f"/{SEED_SESSION}")
    async def seed_session(response: Response, body: _SeedRequest | None = None) -> dict:
        row = body.row if body is not None else {}
        state, observation = await run_in_threadpool(_seed, server, row)
        session_id = store.create(state)
        response.set_cookie(SESSION_COOKIE, session_id, httponly=True, samesite="lax")  # expiry: the server's TTL
        return {"session_id": session_id, "observation": observation}

    @app.post(f"/{VERIFY}")
    async def verify(request: Request, body: _VerifyRequest) -> dict:
        session = _session(request, store)
        return await run_in_threadpool(_verify, server, session, body.row, body.response)

    @app.post(f"/{AGGREGATE_METRICS}")
    async def aggregate_metrics(body: _MetricsRequest) -> dict:
        metrics = await run_in_threadpool(
            _user_code, f"{cls}.aggregate_metrics", server.aggregate_metrics, body.results
        )
        if not isinstance(metrics, dict):
            raise HTTPException(500, f"{cls}.aggregate_metrics returned {type(metrics).__name__}: return a dict")
        return metrics

    @app.get(f"/{TOOLS}")
    async def list_tools() -> dict:
        return {"server": server.name, "tools": [t.spec.to_json() for t in tools.values()]}

    @app.get(f"/{HEALTH}")
    async def health() -> dict:
        return {"status": "ok", "server": server.name, "sessions": len(store)}


def _add_tool_route(app: FastAPI, server: ResourceServer, store: SessionStore, t: _Tool) -> None:
    async def call_tool(request: Request) -> dict:
        session = _session(request, store)
        arguments = _check_arguments(t, await request.body())
        return await run_in_threadpool(_run_tool, server, t, session, arguments)

    app.add_api_route(
        f"/{t.spec.name}",
        call_tool,
        methods=["POST"],
        name=t.spec.name,
        summary=t.spec.description.split("\n")[0] or None,
    )


def _session(request: Request, store: SessionStore) -> Session:
    """The session the X-Session-Id header (first) or the session cookie names."""
    session_id = request.headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE)
    if not session_id:
        raise HTTPException(
            400,
            f"no session: POST /{SEED_SESSION} first and send its session_id in the "
            f"{SESSION_HEADER} header (or keep its {SESSION_COOKIE} cookie)",
        )
    session = store.get(session_id)
    if session is None:
        raise HTTPException(
            404,
            f"unknown session {session_id!r}: it never existed, was idle longer than "
            f"{store.ttl_s:g} s, or the server restarted; POST /{SEED_SESSION} for a new one",
        )
    return session


def _check_arguments(t: _Tool, body: bytes) -> dict:
    """The JSON object of a tool call's body, its names checked against the tool's signature (422 otherwise)."""
    allowed = f"{t.spec.name}'s arguments are {', '.join(t.spec.parameters) or 'none'}"
    try:
        arguments = json.loads(body) if body.strip() else {}
    except ValueError:
        raise HTTPException(
            422, f"the body is not JSON: send {t.spec.name}'s arguments as a JSON object; {allowed}"
        ) from None
    if not isinstance(arguments, dict):
        raise HTTPException(
            422,
            f"the body is a JSON {type(arguments).__name__}: send {t.spec.name}'s arguments "
            f"as a JSON object; {allowed}",
        )
    unknown = sorted(set(arguments) - set(t.spec.parameters))
    if unknown and not t.takes_any:
        raise HTTPException(422, f"unknown argument(s) {', '.join(unknown)} for tool {t.spec.name}: {allowed}")
    missing = [name for name in t.spec.required if name not in arguments]
    if missing:
        raise HTTPException(422, f"tool {t.spec.name} needs argument(s) {', '.join(missing)}: {allowed}")
    return arguments


def _run_tool(server: ResourceServer, t: _Tool, session: Session, arguments: dict) -> dict:
    """{"output": ...} from the tool, or {"output": None, "error": message} when it raises: an observation; with
    "done", the server's is_done after the call."""
    with session.lock:
        try:
            output, error = t.fn(session.state, **arguments), None
        except Exception as exc:
            log.debug("tool %s raised", t.spec.name, exc_info=True)
            output, error = None, str(exc) or type(exc).__name__
        done = _user_code(f"{type(server).__name__}.is_done", server.is_done, session.state)
    if error is None and not isinstance(output, (str, dict)):
        raise HTTPException(500, f"tool {t.spec.name} returned {type(output).__name__}: return a str or a dict")
    return {"output": output, "error": error, DONE: bool(done)}


def _seed(server: ResourceServer, row: dict) -> tuple[dict, str | None]:
    cls = type(server).__name__
    state = _user_code(f"{cls}.seed_session", server.seed_session, row)
    if not isinstance(state, dict):
        raise HTTPException(500, f"{cls}.seed_session returned {type(state).__name__}: return the state as a dict")
    observation = _user_code(f"{cls}.observation", server.observation, state, row)
    if observation is not None and not isinstance(observation, str):
        raise HTTPException(500, f"{cls}.observation returned {type(observation).__name__}: return a str or None")
    return state, observation


def _verify(server: ResourceServer, session: Session, row: dict, response: dict) -> dict:
    """The row's fields, then the components and the reward, and the components' names (so a client can tell)."""
    cls = type(server).__name__
    with session.lock:
        result = _user_code(f"{cls}.verify", server.verify, session.state, row, response)
    reward = result.get(REWARD) if isinstance(result, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise HTTPException(
            500,
            f"{cls}.verify returned {result!r:.200}: return a dict with a finite float "
            "'reward' (and any reward components)",
        )
    components = {key: value for key, value in result.items() if key != REWARD}
    return {**row, **components, REWARD: float(reward), REWARD_COMPONENTS: sorted(components)}


def _user_code(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run the subclass's code: InputError -> 422 with its message, any other exception -> 500 naming it."""
    try:
        return fn(*args)
    except InputError as exc:
        raise HTTPException(422, f"{what}: {exc}") from None
    except HTTPException:
        raise
    except Exception as exc:
        log.exception("%s raised", what)
        raise HTTPException(500, f"{what} raised {type(exc).__name__}: {exc}") from None


@dataclass
class RunningServer:
    """A server running in a background thread of this process: `url` to reach it, `stop()` to end it."""

    url: str
    host: str
    port: int
    app: FastAPI
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting connections, let running requests finish (up to uvicorn's grace period), join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    server: ResourceServer | FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    startup_timeout_s: float = 10.0,
) -> RunningServer:
    """Run a resource server (or a ready app answering GET /health) under uvicorn in a daemon thread.

    The socket is bound here, before the thread starts, so a busy port is an OSError in the caller and port=0's free
    port is known at once (RunningServer.port / url). Returns once /health answers. Binds the loopback interface
    unless another host is passed: sessions are unauthenticated, so exposing a server is the caller's explicit choice.
    """
    app = server if isinstance(server, FastAPI) else build_app(server, session_ttl_s=session_ttl_s)
    if not _is_loopback(host):
        log.warning("resource server bound to %s: reachable from other machines, with no authentication", host)
    sock = _bind(host, port)
    config = uvicorn.Config(
        app, log_config=None, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
    )
    uv = uvicorn.Server(config)
    bound_host, bound_port = sock.getsockname()[:2]
    thread = threading.Thread(
        target=_run_uvicorn, args=(uv, sock), name=f"mrl-resource-server-{bound_port}", daemon=True
    )
    thread.start()
    url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
    running = RunningServer(url, bound_host, bound_port, app, uv, thread)
    try:
        _wait_healthy(url, thread, time.monotonic() + startup_timeout_s)
    except (TimeoutError, RuntimeError):
        running.stop()
        sock.close()
        raise
    return running


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (OSError naming the fix when the port is taken or the host wrong)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(f"cannot serve on {host}:{port}: {exc}; pass an address or name of this machine") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts right after a stop (TIME_WAIT)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot serve on {host}:{port}: {exc.strerror or exc}; the port is in use or {host} is no "
            "address of this machine: pick another port (0 picks a free one) or host"
        ) from None
    return sock


def _run_uvicorn(uv: uvicorn.Server, sock: socket.socket) -> None:
    try:
        uv.run(sockets=[sock])
    except SystemExit:  # uvicorn's way to fail a start-up; it has logged why, and _wait_healthy reports it
        pass


def _wait_healthy(url: str, thread: threading.Thread, deadline: float) -> None:
    with httpx.Client(trust_env=False, timeout=1.0) as client:
        while True:
            try:
                if client.get(f"{url}/{HEALTH}").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if not thread.is_alive():
                raise RuntimeError(f"the server at {url} stopped while starting: see uvicorn's log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/{HEALTH} did not answer 200 in time: does the app have a /{HEALTH} route?")
            time.sleep(0.02)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
