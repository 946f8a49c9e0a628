"""The engine life cycle (asleep / weights awake / fully awake) and the CPU stand-in for vLLM's sleep mode, against
the transitions vLLM 0.32 documents (vllm/entrypoints/llm.py `sleep`, `wake_up`; vllm/v1/engine/core.py: the scheduler
resumes only once every allocation is resident)."""

from __future__ import annotations

import pytest

from mrl.cpu.vllm_sleep_mode import CpuSleepMode, SleepContractError, fill_parameters_with_nan
from mrl.inference.lifecycle import EngineLifecycle, EngineState, EngineStateError

pytestmark = pytest.mark.unit


class _Llm:
    """The two calls of `vllm.LLM` the stand-in guards, recording that they ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return []

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)
        return []


def _engine():
    llm = CpuSleepMode(_Llm())
    lifecycle = EngineLifecycle("engine", sleeps=True, sleep=lambda: llm.sleep(level=1),
                                wake=lambda tags: llm.wake_up(tags=list(tags)))
    return llm, lifecycle


def test_a_refit_wakes_the_weights_and_a_generation_the_kv_cache():
    llm, life = _engine()
    life.sleep()
    with pytest.raises(EngineStateError, match="while the engine is asleep"):
        life.check_load()
    life.wake_weights()
    assert life.state is EngineState.WEIGHTS_AWAKE and llm.released == {"kv_cache"}
    life.check_load()
    llm.collective_rpc("mrl_load_bucket")
    with pytest.raises(EngineStateError, match="while the engine is weights awake"):
        life.check_generate()
    life.wake_all()
    life.check_generate()
    llm.generate([])
    assert [what for what, _ in llm.events] == ["sleep(level=1)", "wake_up(['weights'])", "mrl_load_bucket",
                                               "wake_up(['kv_cache'])", "generate"]
    assert [state for state, _ in life.history] == [EngineState.FULLY_AWAKE, EngineState.ASLEEP,
                                                    EngineState.WEIGHTS_AWAKE, EngineState.FULLY_AWAKE]


def test_transitions_run_once_and_an_engine_that_never_sleeps_allows_everything():
    llm, life = _engine()
    life.wake_all()  # awake already: no wake-up call
    life.sleep()
    life.sleep()
    assert [what for what, _ in llm.events] == ["sleep(level=1)"]
    never = EngineLifecycle("engine", sleeps=False, sleep=lambda: pytest.fail("slept"))
    never.sleep()
    never.check_load()
    never.check_generate()


def test_the_cpu_stand_in_refuses_what_would_break_a_gpu_engine():
    llm, _ = _engine()
    llm.sleep(level=1)
    with pytest.raises(SleepContractError, match="never be scheduled"):
        llm.generate([])
    with pytest.raises(SleepContractError, match="unmapped"):
        llm.collective_rpc("mrl_load_bucket")
    assert llm.collective_rpc("mrl_worker_uss_bytes") == []  # other RPCs run while asleep, as in vLLM
    assert llm.wake_up(tags=["weights"]) is False  # vLLM: not fully awake, the scheduler stays paused
    with pytest.raises(SleepContractError, match="never be scheduled"):
        llm.generate([])
    assert llm.wake_up() is True
    llm.generate([])
    assert llm._llm.calls == ["mrl_worker_uss_bytes", "generate"]
    with pytest.raises(ValueError, match="sleep level 3"):
        llm.sleep(level=3)


def test_a_level_2_sleep_needs_a_complete_refit_before_the_engine_generates():
    """vLLM level 2 keeps no copy of the weights: woken, they are garbage (NaN in the stand-in) until a refit has
    rewritten them; the life cycle refuses to wake such an engine for generation, and a refit clears it."""
    llm = CpuSleepMode(_Llm())
    life = EngineLifecycle("engine", sleeps=True, sleep=lambda: llm.sleep(level=1),
                           wake=lambda tags: llm.wake_up(tags=list(tags)), discard_sleep=lambda: llm.sleep(level=2))
    life.sleep()  # no refit follows (a validation's sleep): level 1, the weights come back
    life.wake_all()
    assert not life.needs_refit and [what for what, _ in llm.events][0] == "sleep(level=1)"
    life.sleep(refit_follows=True)
    assert life.needs_refit and llm.events[-1][0] == "sleep(level=2)"
    with pytest.raises(EngineStateError, match="level-2 sleep"):
        life.wake_all()
    life.wake_weights()
    assert fill_parameters_with_nan in llm._llm.calls  # the woken weights are garbage
    llm.collective_rpc("mrl_begin_refit")
    llm.collective_rpc("mrl_load_bucket")
    with pytest.raises(SleepContractError, match="level-2 sleep discarded"):  # the stand-in refuses on its own too
        llm.released.clear() or llm.generate([])
    llm.released.add("kv_cache")
    llm.collective_rpc("mrl_finish_refit")
    life.refitted()
    life.wake_all()
    llm.generate([])
    assert not life.needs_refit and life.state is EngineState.FULLY_AWAKE
    kept = EngineLifecycle("engine", sleeps=True)  # no discarding sleep (generation.sleep_level 1)
    kept.sleep(refit_follows=True)
    kept.wake_all()
    never = EngineLifecycle("engine", sleeps=False, discard_sleep=lambda: pytest.fail("slept"))  # never asleep
    never.sleep(refit_follows=True)
    assert not never.needs_refit
