"""Resource servers over real HTTP on loopback (each started by serve(...) on a free port), and their clients against
servers that work, are down, are slow, or answer garbage."""

import asyncio
import inspect
import socket
import time
from fractions import Fraction

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from mrl.cli import build_parser, main
from mrl.environments.servers import (EXAMPLES, AsyncResourceClient, Calculator, GuessNumber, ResourceClient,
                                      ResourceServer, SessionHandle, build_app, serve, tool)
from mrl.environments.servers.examples import evaluate, parse_whole_number
from mrl.environments.servers.resource import SessionStore

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def guess_server():
    with serve(GuessNumber()) as running:
        yield running


@pytest.fixture(scope="module")
def calculator_server():
    with serve(Calculator()) as running:
        yield running


def _play(client: ResourceClient, session: SessionHandle) -> list[str]:
    """Binary search with the guess tool until "correct" (or anything else): the answers, in order."""
    low, high, answers = 0, 99, []
    while True:
        guess = (low + high) // 2
        answers.append(client.call_tool(session, "guess", {"number": str(guess)}).output)
        if answers[-1] == "higher":
            low = guess + 1
        elif answers[-1] == "lower":
            high = guess - 1
        else:
            return answers


def test_a_guess_number_episode_over_http(guess_server):
    row = {"secret": 73, "max_turns": 7}
    with ResourceClient(guess_server.url) as client:
        assert [(t.name, t.parameters, t.required) for t in client.tools()] == [("guess", ("number",), ("number",))]
        session = client.seed_session(row)
        assert session.ok and session.session_id and "0 to 99" in session.observation
        bad = client.call_tool(session, "guess", {"number": "seventy"})
        assert (bad.output, bad.error_kind) == (None, "tool") and "not a whole number" in bad.error
        answers = _play(client, session)
        assert answers[-1] == "correct" and set(answers[:-1]) <= {"higher", "lower"}
        result = client.verify(session, row, {"text": "found it"})
        assert result.error is None and result.reward == 1.0
        assert result.components == {"found": True, "turns": len(answers), "tool_errors": 1}

        near = {"secret": 30, "max_turns": 2}
        other = client.seed_session(near)
        assert [client.call_tool(other, "guess", {"number": n}).output for n in (90, 40.0, 35)] == [
            "lower", "lower", "no turns left"]
        partial = client.verify(other, near, {"text": ""})
        assert partial.reward == pytest.approx((1 - 10 / 100) * 0.5)   # the last guess, 40, is 10 away
        assert partial.components == {"found": False, "turns": 2, "tool_errors": 0}

        assert client.call_tool(other, "guess", {"number": 35}).done   # out of guesses: done with every call

        metrics = client.aggregate_metrics([{"reward": result.reward, **result.components},
                                            {"reward": partial.reward, **partial.components}])
        assert metrics["reward"] == pytest.approx(0.725) and metrics["found"] == 0.5
        assert client.errors == {}   # a tool's own error is an observation, not a server problem


def test_a_row_sets_the_range_and_done_comes_with_the_call_that_ends_the_game(guess_server):
    row = {"secret": 6, "low": 1, "high": 8, "max_turns": 3}
    with ResourceClient(guess_server.url) as client:
        session = client.seed_session(row)
        assert "from 1 to 8" in session.observation
        out_of_range = client.call_tool(session, "guess", {"number": 9})
        assert (out_of_range.error_kind, out_of_range.done) == ("tool", False) and "from 1 to 8" in out_of_range.error
        calls = [client.call_tool(session, "guess", {"number": n}) for n in (4, 6)]
        assert [(c.output, c.done) for c in calls] == [("higher", False), ("correct", True)]
        missed = {"secret": 1, "low": 1, "high": 8, "max_turns": 1}
        other = client.seed_session(missed)
        assert client.call_tool(other, "guess", {"number": 5}).done   # the one guess is spent
        assert client.verify(other, missed, {}).reward == pytest.approx((1 - 4 / 8) * 0.5)   # 4 away in a range of 8
        assert not client.seed_session({"secret": 0, "low": 1, "high": 8}).ok   # the secret out of its range: 422
    assert client.errors == {"http_422": 1}


def test_the_cookie_path_and_the_verify_answer_with_plain_httpx(guess_server):
    with httpx.Client(base_url=guess_server.url, trust_env=False) as http:
        seeded = http.post("/seed_session", json={"row": {"secret": 5, "max_turns": 3}})
        assert seeded.status_code == 200 and http.cookies["mrl_session"] == seeded.json()["session_id"]
        assert http.post("/guess", json={"number": 5}).json() == {"output": "correct", "error": None, "done": True}
        verified = http.post("/verify", json={"row": {"secret": 5, "max_turns": 3, "id": "r1"}, "response": {}})
        assert verified.json() == {"secret": 5, "max_turns": 3, "id": "r1", "reward": 1.0, "found": True, "turns": 1,
                                   "tool_errors": 0, "reward_components": ["found", "tool_errors", "turns"]}
        assert http.get("/health").json()["status"] == "ok"


def test_http_errors_say_what_to_fix(guess_server):
    with httpx.Client(base_url=guess_server.url, trust_env=False) as http:
        header = {"X-Session-Id": http.post("/seed_session", json={"row": {"secret": 1}}).json()["session_id"]}
        http.cookies.clear()
        unknown = http.post("/guess", json={"number": 1}, headers={"X-Session-Id": "nope"})
        assert unknown.status_code == 404 and "unknown session 'nope'" in unknown.json()["detail"]
        assert "POST /seed_session" in unknown.json()["detail"]
        assert http.post("/guess", json={"number": 1}).status_code == 400           # no session at all
        wrong_name = http.post("/guess", json={"n": 1}, headers=header)
        assert wrong_name.status_code == 422 and "guess's arguments are number" in wrong_name.json()["detail"]
        assert "needs argument(s) number" in http.post("/guess", json={}, headers=header).json()["detail"]
        assert http.post("/guess", content=b"{oops", headers=header).status_code == 422
        no_tool = http.post("/search", json={}, headers=header)
        assert no_tool.status_code == 404 and "tools are guess" in no_tool.json()["detail"]
        bad_row = http.post("/seed_session", json={"row": {"secret": 100}})
        assert bad_row.status_code == 422 and "from 0 to 99" in bad_row.json()["detail"]
    with ResourceClient(guess_server.url) as client:
        result = client.call_tool(SessionHandle("nope"), "guess", {"number": 1})
        assert result.error_kind == "http_404" and "unknown session 'nope'" in result.error
        assert client.verify(SessionHandle("nope"), {}, {}).reward == 0.0
        assert client.errors == {"http_404": 2}
        reserved = client.call_tool(SessionHandle("nope"), "seed_session", {})  # never sent: not a tool's path
        assert reserved.error == "unknown tool 'seed_session'" and client.errors == {"http_404": 2}
        with pytest.raises(TypeError, match="SessionHandle"):
            client.call_tool("nope", "guess", {"number": 1})


def test_idle_sessions_expire():
    clock = [0.0]
    store = SessionStore(ttl_s=10.0, clock=lambda: clock[0])
    first = store.create({})
    clock[0] = 5.0
    assert store.get(first) is not None           # a use restarts the idle clock
    clock[0] = 14.0
    second = store.create({})
    assert store.get(first) is not None and len(store) == 2
    clock[0] = 100.0
    store.create({})                              # purges the idle ones
    assert len(store) == 1 and store.get(second) is None
    with serve(GuessNumber(), session_ttl_s=0.2) as running, ResourceClient(running.url) as client:
        session = client.seed_session({"secret": 1})
        time.sleep(0.4)
        assert "idle longer than 0.2 s" in client.call_tool(session, "guess", {"number": 1}).error


@pytest.mark.parametrize("expression, value", [
    ("12*7+3", 87), ("(1+2)*(3+4)", 21), ("-3 - -4", 1), ("1/3*3", 1), ("0.1+0.2", Fraction(3, 10)),
    ("7/2", Fraction(7, 2)), ("  +5 ", 5), ("2*(3+(4-1))/4", 3),
])
def test_the_calculator_evaluates_arithmetic_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "function call"), ("x + 1", "the name 'x'"), ("abs(-3)", "function call"),
    ("2**10**10", "Pow"), ("9**9", "Pow"), ("(1).real", "Attribute"), ("1 < 2", "Compare"), ("'1' + '2'", "constant"),
    ("[1, 2]", "List"), ("lambda: 1", "Lambda"), ("1/0", "division by zero"), ("9e999", "too large"),
    ("99999999999999999 * 99999999999999999", "exceeds"), ("1+" * 150 + "1", "at most 200"), ("1 +", "cannot parse"),
    (42, "must be a string"),
])
def test_the_calculator_refuses_everything_but_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_lenient_whole_numbers():
    assert [parse_whole_number(v) for v in (42, 42.0, "42", " +42 ", "42.00", "-3")] == [42, 42, 42, 42, 42, -3]
    for bad in ("forty", "4.5", 4.5, True, None, "", "4 2"):
        with pytest.raises(ValueError, match="whole number|not a number"):
            parse_whole_number(bad)


def test_a_calculator_episode_over_http(calculator_server):
    row = {"question": "12*7+3", "answer": "87"}
    with ResourceClient(calculator_server.url) as client:
        session = client.seed_session(row)
        assert "12*7+3" in session.observation
        assert client.call_tool(session, "calculate", {"expression": "12*7+3"}).output == "87"
        refused = client.call_tool(session, "calculate", {"expression": "__import__('os')"})
        assert refused.output is None and "not allowed" in refused.error
        right = client.verify(session, row, {"text": "12*7 = 84, plus 3: the answer is 87.0"})
        assert (right.reward, right.components) == (1.0, {"tool_calls": 2})
        assert client.verify(session, row, {"text": "I think it is 86"}).reward == 0.0
        assert client.verify(session, row, {}).error_kind == "http_422"   # no response text: the caller's slip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_down_server_gives_errors_not_exceptions():
    with ResourceClient(f"http://127.0.0.1:{_free_port()}", timeout_s=2.0) as client:
        session = client.seed_session({"secret": 1})
        assert (session.ok, session.session_id, session.error_kind) == (False, "", "down")
        tool_result = client.call_tool(session, "guess", {"number": 1})   # fails at once: not counted again
        assert tool_result.output is None and "no session" in tool_result.error
        result = client.verify(session, {"secret": 1}, {})
        assert (result.reward, result.error_kind) == (0.0, "down")
        assert client.tools() == [] and client.aggregate_metrics([]) == {}
        assert client.errors == {"down": 3} and "ConnectError" in client.last_error


class Sleepy(ResourceServer):
    name = "sleepy"

    @tool
    def nap(self, state: dict, seconds: float) -> str:
        time.sleep(seconds)
        return "awake"

    @tool
    def broken(self, state: dict) -> int:
        return 3   # neither str nor dict: a bug in the server, answered 500

    def verify(self, state: dict, row: dict, response: dict) -> dict:
        return {"score": 1.0}   # no "reward": a bug in the server, answered 500


def test_a_slow_server_times_out_and_a_buggy_one_answers_500():
    with serve(Sleepy()) as running, ResourceClient(running.url) as client:
        with ResourceClient(running.url, timeout_s=0.3) as impatient:
            slow = impatient.call_tool(client.seed_session({}), "nap", {"seconds": 1.5})
            assert (slow.output, slow.error_kind) == (None, "timeout") and impatient.errors == {"timeout": 1}
        session = client.seed_session({})   # other sessions are not held up by the napping one
        assert client.call_tool(session, "nap", {"seconds": 0}).output == "awake"
        assert "return a str or a dict" in client.call_tool(session, "broken").error
        assert "finite float 'reward'" in client.verify(session, {}, {}).error
        assert client.errors == {"http_500": 2}


def _malformed_app() -> FastAPI:
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.post("/seed_session")(lambda: PlainTextResponse("session created!"))
    app.post("/guess")(lambda: JSONResponse(["higher"]))
    app.post("/verify")(lambda: {"score": 1.0})
    app.get("/tools")(lambda: {"tools": [{"title": "guess"}]})
    app.post("/aggregate_metrics")(lambda: PlainTextResponse("boom", status_code=503))
    return app


def test_a_malformed_server_gives_errors_not_exceptions():
    with serve(_malformed_app()) as running, ResourceClient(running.url) as client:
        assert client.seed_session({}).error_kind == "malformed"
        assert client.call_tool(SessionHandle("s"), "guess", {"number": 1}).error_kind == "malformed"
        result = client.verify(SessionHandle("s"), {}, {"text": ""})
        assert (result.reward, result.error_kind) == (0.0, "malformed") and "'reward'" in result.error
        assert client.tools() == []
        assert client.aggregate_metrics([]) == {}
        assert client.errors == {"malformed": 4, "http_503": 1}


def test_sixteen_concurrent_sessions_with_the_async_client():
    async def episode(client: AsyncResourceClient, secret: int) -> tuple[str, float]:
        row = {"secret": secret, "max_turns": 7}
        session = await client.seed_session(row)
        low, high = 0, 99
        while (answer := (await client.call_tool(session, "guess", {"number": (low + high) // 2})).output) != "correct":
            mid = (low + high) // 2
            low, high = (mid + 1, high) if answer == "higher" else (low, mid - 1)
        return session.session_id, (await client.verify(session, row, {})).reward

    async def run(url: str) -> list[tuple[str, float]]:
        async with AsyncResourceClient(url) as client:
            results = await asyncio.gather(*(episode(client, 6 * i + 1) for i in range(16)))
            assert client.errors == {}
            return results

    async def down() -> AsyncResourceClient:
        async with AsyncResourceClient(f"http://127.0.0.1:{_free_port()}") as client:
            assert (await client.verify(SessionHandle("s"), {}, {})).error_kind == "down"
            return client

    with serve(GuessNumber()) as running:
        results = asyncio.run(run(running.url))
        assert len({sid for sid, _ in results}) == 16 and [r for _, r in results] == [1.0] * 16
        assert httpx.get(f"{running.url}/health", trust_env=False).json()["sessions"] == 16
    assert asyncio.run(down()).errors == {"down": 1}


def test_serve_binds_loopback_by_default_and_names_a_busy_port():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    with serve(GuessNumber()) as running:
        assert running.host == "127.0.0.1" and running.url == f"http://127.0.0.1:{running.port}"
        assert running._server.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"
        with pytest.raises(OSError, match="port is in use"):
            serve(GuessNumber(), port=running.port)
    assert not running.alive


def test_servers_that_cannot_work_are_refused_with_the_fix():
    class Nameless(ResourceServer):
        pass

    class Clash(ResourceServer):
        name = "clash"

        @tool
        def verify(self, state: dict, row: dict, response: dict) -> dict:
            return {"reward": 0.0}

    with pytest.raises(ValueError, match="set the class attribute `name"):
        build_app(Nameless())
    with pytest.raises(ValueError, match="rename the tool"):
        build_app(Clash())


def test_mrl_env_serve_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--port" in help_text and "--host" in help_text and all(name in help_text for name in EXAMPLES)
    args = build_parser().parse_args(["env", "serve", "calculator"])
    assert (args.command, args.env_command, args.name, args.host, args.port) == (
        "env", "serve", "calculator", "127.0.0.1", 8000)
    assert main(["env", "serve", "nope"]) == 2
    assert "choose one of guess_number, calculator" in capsys.readouterr().err
