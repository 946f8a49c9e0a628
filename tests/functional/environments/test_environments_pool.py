"""The Ray verifier pool: failing and hanging verifiers score 0 within the timeout, are counted, and the pool
keeps working; an actor that dies (under a sample or while starting) is replaced and changes no score; a replacement
that cannot start is a named worker failure; the math environment end to end through the pool."""

import functools
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from mrl.distributed.errors import WorkerError  # noqa: E402
from mrl.environments.math import MathEnvironment  # noqa: E402
from mrl.environments.verifier_pool import VerifierPool  # noqa: E402

TIMEOUT_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The test module is not importable inside Ray workers: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def flaky_verify(response: str, answer: str) -> float:
    """Test-only verifier: misbehaves on command."""
    if response == "raise":
        raise RuntimeError("verifier bug")
    if response == "sleep":
        time.sleep(3600)
    if response == "spin":
        while True:
            pass
    if response == "nan":
        return float("nan")
    return float(response == answer)


def test_raising_and_hanging_verifiers_score_zero_within_the_timeout():
    pool = VerifierPool(flaky_verify, num_workers=2, timeout_s=TIMEOUT_S)
    try:
        assert pool.score(["a"], ["a"]).scores == [1.0]  # workers are up
        responses = ["1", "2", "raise", "sleep", "3", "spin", "nan", "4"]
        answers = ["1", "x", "1", "1", "3", "1", "1", "4"]
        start = time.monotonic()
        result = pool.score(responses, answers)
        elapsed = time.monotonic() - start
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
        assert [i for i, e in enumerate(result.errors) if e] == [2, 3, 5, 6]
        assert "RuntimeError: verifier bug" in result.errors[2]
        assert "timed out" in result.errors[3] and "timed out" in result.errors[5]
        assert result.num_errors == 4 and result.num_restarts == 2
        # The two hangs run side by side on the two workers; the good samples wait for a replacement at worst.
        assert elapsed < 2 * TIMEOUT_S + 10.0, elapsed
        # The replacements work, and a quick batch is quick again.
        start = time.monotonic()
        assert pool.score(["5", "6"], ["5", "7"]).scores == [1.0, 0.0]
        assert time.monotonic() - start < TIMEOUT_S
    finally:
        pool.shutdown()


def test_one_hanging_sample_delays_the_batch_by_about_its_timeout():
    pool = VerifierPool(flaky_verify, num_workers=2, timeout_s=TIMEOUT_S)
    try:
        pool.score(["a", "b"], ["a", "b"])  # wait until both workers are ready
        start = time.monotonic()
        result = pool.score(["sleep"] + [str(i) for i in range(20)], ["0"] + [str(i) for i in range(20)])
        elapsed = time.monotonic() - start
        assert result.scores == [0.0] + [1.0] * 20 and result.num_errors == 1
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3.0, elapsed  # the other worker scored the rest meanwhile
    finally:
        pool.shutdown()


def test_a_first_batch_long_after_the_start_is_scored():
    """The first batch can come after every start-up and sample deadline has passed (a generation of minutes):
    actors that are ready and results that have arrived count, whatever their deadline."""
    pool = VerifierPool(flaky_verify, num_workers=2, timeout_s=TIMEOUT_S, startup_timeout_s=2.0)
    try:
        starting = list(pool._starting)  # the actors' ready() calls
        assert len(ray.wait(starting, num_returns=len(starting), timeout=120)[0]) == 2  # both up, however loaded
        time.sleep(2.5)  # ... and the start-up deadline has passed before the first batch
        result = pool.score(["1", "2", "3"], ["1", "2", "x"])
        assert result.scores == [1.0, 1.0, 0.0] and result.num_errors == 0 and result.num_restarts == 0
    finally:
        pool.shutdown()


def crashing_verify(response: str, answer: str) -> float:
    """Test-only verifier whose process dies on "crash"."""
    if response == "crash":
        os._exit(1)
    return float(response == answer)


def fail_once_marked(marker: str) -> None:
    """Test-only warm-up: fails once `marker` exists (a verifier library that broke after the first start)."""
    if os.path.exists(marker):
        raise ImportError("the verifier's library cannot be imported")


def die_once_marked(marker: str, response: str = "", answer: str = "") -> float:
    """Test-only verifier or warm-up: the first process to call it dies (an OOM kill, a lost worker); later calls
    score as usual."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return float(response == answer)


def test_an_actor_that_dies_under_a_sample_is_replaced_and_the_sample_scored_again(tmp_path):
    pool = VerifierPool(functools.partial(die_once_marked, str(tmp_path / "died")), num_workers=1, timeout_s=10.0)
    try:
        result = pool.score(["1", "2", "3"], ["1", "x", "3"])
        assert (tmp_path / "died").exists()
        assert result.scores == [1.0, 0.0, 1.0] and result.num_errors == 0 and result.num_restarts == 1
    finally:
        pool.shutdown()


def test_a_sample_that_kills_its_verifier_twice_scores_zero_and_the_pool_goes_on():
    pool = VerifierPool(crashing_verify, num_workers=2, timeout_s=10.0)
    try:
        result = pool.score(["1", "crash", "3"], ["1", "1", "3"])
        assert result.scores == [1.0, 0.0, 1.0] and result.num_restarts == 2
        assert [i for i, e in enumerate(result.errors) if e] == [1] and "verifier worker died" in result.errors[1]
        assert pool.score(["4"], ["4"]).scores == [1.0]
    finally:
        pool.shutdown()


def test_an_actor_that_dies_while_starting_is_started_again(tmp_path):
    pool = VerifierPool(flaky_verify, num_workers=1, timeout_s=10.0,
                        warmup=functools.partial(die_once_marked, str(tmp_path / "died")))
    try:
        assert pool.score(["1", "2"], ["1", "x"]).scores == [1.0, 0.0]
        assert (tmp_path / "died").exists() and pool.num_workers == 1
    finally:
        pool.shutdown()


def test_a_replacement_that_cannot_start_is_a_named_worker_failure(tmp_path):
    """Before, a bare RuntimeError: a traceback and exit 1 instead of the run's one message and exit 4."""
    marker = tmp_path / "broken"
    pool = VerifierPool(crashing_verify, num_workers=1, timeout_s=10.0,
                        warmup=functools.partial(fail_once_marked, str(marker)))
    try:
        assert pool.score(["1"], ["1"]).scores == [1.0]
        marker.write_text("")
        with pytest.raises(WorkerError) as failed:  # the sample's actor dies, its replacement cannot start
            pool.score(["crash", "2"], ["1", "2"])
        assert failed.value.group == "verifiers" and failed.value.method == "ready"
        assert "a verifier worker failed to start: ImportError: the verifier's library cannot be imported" \
            in str(failed.value)
    finally:
        pool.shutdown()


def test_math_environment_through_the_pool():
    env = MathEnvironment(num_workers=2, timeout_s=10.0)
    try:
        logs = [[{"role": "user", "content": "Half of one?"}, {"role": "assistant", "content": text}]
                for text in ["It is \\boxed{0.5}", "It is \\boxed{\\frac{1}{2}}", "\\boxed{2}", "\\boxed{0.5}"]]
        meta = [{"answer": "\\frac{1}{2}", "finished": True}, {"answer": "1/2", "finished": True},
                {"answer": "\\frac{1}{2}", "finished": True}, {"answer": "\\frac{1}{2}", "finished": False}]
        out = env.step(logs, meta)
        assert out.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # the last one did not end with EOS
        assert out.num_errors == 0
        # What math-verify read (its string form: 0.5 becomes \frac{1}{2}); truncated samples are not read.
        assert [m["extracted_answer"] for m in out.metadata] == ["\\frac{1}{2}", "\\frac{1}{2}", "2", None]
    finally:
        env.shutdown()


def test_math_environment_counts_verifier_failures_as_reward_errors():
    env = MathEnvironment(num_workers=2, timeout_s=TIMEOUT_S, verify_fn=flaky_verify, warmup=None)
    try:
        logs = [[{"role": "assistant", "content": text}] for text in ["7", "raise", "sleep", "7"]]
        meta = [{"answer": "7", "finished": True}] * 4
        out = env.step(logs, meta)
        assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert out.num_errors == 2
        assert "reward_error" in out.metadata[1] and "timed out" in out.metadata[2]["reward_error"]
    finally:
        env.shutdown()
