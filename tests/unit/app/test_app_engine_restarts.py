"""Engine restarts with fakes (mrl/app/engine_restarts.py, mrl/app/runtime.py): the real GRPO loop (`grpo_train`), the
real runtime's start and restart code and the real refit loop drive a fake engine group that dies once, at one
moment of its life; the run then logs exactly what an uninterrupted run logs (the fake samples from its weights and
the request's seed, as a seeded vLLM does). A death at the start, and one of a replacement that is starting, is
another restart; past `generation.max_restarts` the command ends with exit 4, one message and the resume command,
no traceback. Whole runs with real engines killed for real: tests/faults/test_faults_engine.py."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mrl.algorithms.grpo import grpo_train
from mrl.app import runtime as runtime_module
from mrl.app.model_source import ModelSource
from mrl.app.runtime import Runtime
from mrl.config.schema import MrlConfig
from mrl.data.arith import build_arith_tokenizer
from mrl.data.datasets import Problem
from mrl.data.tasks import TaskData
from mrl.data.templates import PromptTemplate
from mrl.distributed import WorkerDiedError
from mrl.environments.arith import ArithEnvironment
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput
from mrl.inference.lifecycle import WEIGHTS, EngineLifecycle
from mrl.logging.metrics import MetricsLogger

pytestmark = pytest.mark.unit

INITIAL = "initial weights"  # what the model's files hold, and the policy before its first step


class _Faults:
    """Deaths to come, as mrl/distributed/faults.py has them: (method, hit) kills the engine group making its
    `hit`-th call of `method` (counted per group, as per process there; starts are counted over the run: the
    `hit`-th group started), once in the whole run."""

    def __init__(self, *points: tuple[str, int]) -> None:
        self.points = set(points)
        self.struck: list[tuple[str, int]] = []
        self.starts = 0


class _Engines:
    """The calls a vLLM engine group (mrl/inference/vllm_worker.py) makes to its workers, on a real state machine;
    a dead group fails every call after its death, as Ray does. Samples are a function of the weights held, the
    prompt and the request's seed."""

    def __init__(self, faults: _Faults, tokenizer: Any, *, load_weights: bool) -> None:
        self.workers = SimpleNamespace(name="generation")
        self.expected_names = None
        self.faults, self.calls, self.dead = faults, Counter(), False
        self.weights = INITIAL if load_weights else "random weights"
        self._loading: str | None = None
        self._digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        self._eos = tokenizer.eos_token_id
        self.lifecycle = EngineLifecycle(
            "fake engines", sleeps=True, sleep=lambda: self._call("finish_generation"),
            wake=lambda tags: self._call("wake_weights" if tuple(tags) == (WEIGHTS,) else "prepare_for_generation"))
        self.calls["VllmEngineWorker.__init__"] = faults.starts
        faults.starts += 1
        self._call("VllmEngineWorker.__init__")

    def _call(self, method: str) -> None:
        if not self.dead:
            self.calls[method] += 1
            point = (method, self.calls[method])
            if point not in self.faults.points:
                return
            self.faults.points.discard(point)
            self.faults.struck.append(point)
            self.dead = True
        raise WorkerDiedError(f"worker group 'generation' rank 0 (node 192.0.2.2, pid 4242) died while running "
                              f"'{method}': Worker exit type: SYSTEM_ERROR. The group cannot continue; shut it down "
                              "and restart (from a checkpoint)", group="generation", rank=0, method=method)

    def generate(self, prompts, sampling) -> GenerationOutput:
        self.lifecycle.check_generate()
        self._call("generate_shard")
        samples = []
        for i, prompt in enumerate(prompts):
            for k in range(sampling.n):
                digest = hashlib.sha256(f"{self.weights}|{list(prompt)}|{sampling.seed}|{i}|{k}".encode()).digest()
                tokens = [self._digits[digest[0] % 10], self._eos]
                samples.append(GeneratedSample(i, k, list(prompt), tokens, [-digest[1] / 256, -0.1],
                                               FinishReason.STOP))
        return GenerationOutput(samples, num_prompts=len(prompts), n=sampling.n)

    def prepare_for_generation(self) -> None:
        self.lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        self.lifecycle.sleep(refit_follows)

    def prepare_for_refit(self) -> None:
        self.lifecycle.wake_weights()
        self._call("begin_refit")

    def load_payload(self, payload: dict) -> None:
        self.lifecycle.check_load()
        self._call("load_payload")
        self._loading = payload["weights"]

    def finish_refit(self, complete: bool = True) -> None:
        self._call("finish_refit")
        if complete:
            self.weights = self._loading
            self.lifecycle.refitted()

    def shutdown(self) -> None:
        pass


class _Policy:
    """A policy whose weights are a digest of every batch it trained on; refits in two buckets."""

    data_parallel_size = 1

    def __init__(self) -> None:
        self.weights = INITIAL

    def plan_buckets(self, bucket_bytes: int) -> range:
        return range(2)

    def send_bucket(self, index: int, transport: Any) -> dict:
        return {"names": [f"layer.{index}"], "bytes": 8, "weights": self.weights}

    def train(self, batch, loss_fn, temperature: float = 1.0) -> dict[str, float]:
        seen = f"{self.weights}|{batch.input_ids.tolist()}|{batch.token_data['advantages'].tolist()}"
        self.weights = hashlib.sha256(seen.encode()).hexdigest()
        return {"loss": float((batch.token_data["advantages"] * batch.loss_mask).sum())}

    def logprobs(self, batch, reference: bool = False) -> torch.Tensor:
        return torch.zeros(batch.loss_mask.shape)

    def shutdown(self) -> None:
        pass


class _Transport:
    meets, in_flight = False, 1

    def release(self, payload: dict) -> None:
        pass


class _Checkpoints:
    stop_requested = False

    def resume_newest(self, last_step=None, steps_key="") -> None:
        return None

    def due(self, step: int, last_step: int, *, final: bool = False) -> bool:
        return False

    def stops_after(self, step: int, *, done: bool) -> bool:
        return done


def _config(output_dir: Path, **generation: Any) -> MrlConfig:
    return MrlConfig.model_validate({
        "run": {"output_dir": str(output_dir)},  # the run writes its validation samples there
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 3, "val_every": 2,
                 "max_idle_steps": 0},
        "policy": {"train_global_batch_size": 16, "max_total_sequence_length": 16},
        "generation": {"max_new_tokens": 2, **generation}, "eval": {"num_samples": 2, "max_problems": 4},
        "logger": {"log_every": 1}})


def _grpo_run(monkeypatch, tmp_path: Path, faults: _Faults, **generation: Any) -> tuple[dict, Runtime]:
    """A GRPO run of three steps (validation at steps 0, 2 and 3) on the fakes: its logged metrics by step."""
    tokenizer = build_arith_tokenizer()
    cfg = _config(tmp_path / "run", **generation)
    monkeypatch.setattr(runtime_module, "_build_engine",
                        lambda runtime, share, *, load_weights: _Engines(faults, tokenizer, load_weights=load_weights))
    runtime = Runtime(cfg, ModelSource(Path("model")), tokenizer, SimpleNamespace(shutdown=lambda: None),
                      trains=True)
    runtime._local = _Transport()
    runtime_module._start_engine(runtime, 0.5, sleep=True)  # the colocated start: started, then asleep
    runtime.policy = _Policy()
    problems = [Problem(f"{a}+{b}=", str(a + b), row) for row, (a, b) in enumerate((a, b) for a in range(4)
                                                                                   for b in range(4))]
    data = TaskData(problems, problems[:4], PromptTemplate("plain", ""))
    logger = MetricsLogger([])
    grpo_train(cfg, runtime, ArithEnvironment(), data, logger, _Checkpoints())  # type: ignore[arg-type]
    steps: dict[int, dict[str, float]] = {}
    for name, values in logger.history.items():
        for step, value in values:
            steps.setdefault(step, {})[name] = value
    return steps, runtime


def _results(steps: dict) -> dict:
    return {step: {k: v for k, v in row.items() if not k.startswith("timing/") and k != "train/engine_restarts"}
            for step, row in steps.items()}


#: Every moment of an engine's life in the run: its name -> (the worker method, its hit in the first engine). The
#: first engine starts, sleeps (1), wakes for validation (1: step 0), sleeps (2), wakes for step 1 (2), ...
MOMENTS = {
    "start": ("VllmEngineWorker.__init__", 1),
    "start-up sleep": ("finish_generation", 1),
    "wake-up for validation": ("prepare_for_generation", 1),
    "validation": ("generate_shard", 1),
    "sleep after validation": ("finish_generation", 2),
    "wake-up for step 1": ("prepare_for_generation", 2),
    "generation of step 1": ("generate_shard", 2),
    "sleep after step 1's rollouts": ("finish_generation", 3),
    "wake-up of the weights for a refit": ("wake_weights", 1),
    "refit's opening": ("begin_refit", 1),
    "refit's first bucket": ("load_payload", 1),
    "refit's second bucket": ("load_payload", 2),
    "refit's close": ("finish_refit", 1),
    "wake-up for step 2": ("prepare_for_generation", 3),
    "wake-up for validation at step 2": ("prepare_for_generation", 4),
    "sleep after validation at step 2": ("finish_generation", 5),
    "wake-up for the last validation": ("prepare_for_generation", 6),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_an_engine_that_dies_at_any_moment_is_replaced_and_the_run_logs_what_an_uninterrupted_run_logs(
        monkeypatch, tmp_path, capsys, moment):
    uninterrupted, _ = _grpo_run(monkeypatch, tmp_path, _Faults())
    faults = _Faults(MOMENTS[moment])
    faulted, runtime = _grpo_run(monkeypatch, tmp_path, faults)
    assert faults.struck == [MOMENTS[moment]]  # it died where it should have
    assert runtime.engine_restarts == 1
    assert _results(faulted) == _results(uninterrupted)
    assert sorted(faulted) == [0, 1, 2, 3] and faulted[3]["train/engine_restarts"] == 1.0
    method = MOMENTS[moment][0]
    assert f"[mrl] engine rank 0 died in '{method}'; restarting the engines" in capsys.readouterr().err


def test_a_replacement_that_dies_while_starting_is_one_restart_more(monkeypatch, tmp_path, capsys):
    uninterrupted, _ = _grpo_run(monkeypatch, tmp_path, _Faults())
    # the first engine dies waking for step 1; its replacement dies in its own start, the next one takes over
    faults = _Faults(("prepare_for_generation", 2), ("VllmEngineWorker.__init__", 2))
    faulted, runtime = _grpo_run(monkeypatch, tmp_path, faults)
    assert runtime.engine_restarts == 2 and len(faults.struck) == 2
    assert _results(faulted) == _results(uninterrupted)
    err = capsys.readouterr().err
    assert "died in 'prepare_for_generation'; restarting the engines with the policy's current weights (restart 1" \
        in err
    assert "died in 'VllmEngineWorker.__init__'; restarting the engines with the policy's current weights (restart 2" \
        in err


def test_past_max_restarts_the_death_itself_ends_the_run(monkeypatch, tmp_path, capsys):
    faults = _Faults(("prepare_for_generation", 2), ("VllmEngineWorker.__init__", 2))
    with pytest.raises(WorkerDiedError) as died:
        _grpo_run(monkeypatch, tmp_path, faults, max_restarts=1)
    assert died.value.method == "VllmEngineWorker.__init__"  # the replacement's death, not a consequence of it
    assert "the engine is not restarted: generation.max_restarts=1 restart(s) used up" in capsys.readouterr().err


class _Placement:
    on_gpus = False


def _command_start(tmp_path, monkeypatch, faults: _Faults, policy_dies: bool = False) -> int:
    """`mrl grpo` through the whole command line (`mrl.cli.main`) up to the start, with Ray and the workers faked:
    the colocated policy waits for the engine to start and sleep, then builds (`policy_dies`: its rank dies then)."""
    from mrl import cli
    from mrl.testing.runs import RECIPE, SHORT_ARITH

    tokenizer = build_arith_tokenizer()

    def policy(cfg, spec, placement, share, *, wait=None, name="policy"):
        wait()
        if policy_dies:
            raise WorkerDiedError("worker group 'policy' rank 0 (node 192.0.2.2, pid 4343) died while running "
                                  "'PolicyWorker.__init__': Worker exit type: SYSTEM_ERROR. The group cannot "
                                  "continue", group="policy", rank=0, method="PolicyWorker.__init__")
        return _Policy()

    monkeypatch.setattr(runtime_module.RayCluster, "from_config",
                        staticmethod(lambda config: SimpleNamespace(shutdown=lambda: None)))
    monkeypatch.setattr(runtime_module, "reserve_placement", lambda cfg, cluster: _Placement())
    monkeypatch.setattr(runtime_module, "_start_policy", policy)
    monkeypatch.setattr(runtime_module, "_build_engine",
                        lambda runtime, share, *, load_weights: _Engines(faults, tokenizer, load_weights=load_weights))
    return cli.main(["grpo", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={tmp_path}",
                     "generation.max_restarts=1"])


def test_an_engine_start_that_keeps_dying_ends_the_command_with_exit_4_and_the_resume_command(
        tmp_path, monkeypatch, capsys):
    """Every engine start dies. Before, the colocated policy's consequence ("the colocated engine did not start
    ...") was raised instead of the engine's death, as a traceback with exit 1."""
    faults = _Faults()
    faults.points = _Always("VllmEngineWorker.__init__")  # every start dies
    code = _command_start(tmp_path, monkeypatch, faults)
    err = capsys.readouterr().err
    assert code == 4, err
    assert "Traceback" not in err and "did not start" not in err
    assert "restarting the engines (the run is starting) (restart 1 of at most 1" in err
    assert "[mrl] the engine is not restarted: generation.max_restarts=1 restart(s) used up" in err
    message = err[err.index("mrl: run failed:"):]
    assert "worker group 'generation' rank 0" in message and "died while running 'VllmEngineWorker.__init__'" in message
    assert "no checkpoint was written yet" in message and "starts it again from the beginning" in message


def test_a_policy_rank_that_dies_while_the_run_starts_ends_the_command_with_exit_4(tmp_path, monkeypatch, capsys):
    """Before, `start_runtime` ran outside `explained_failures`: the death was a traceback with exit 1."""
    code = _command_start(tmp_path, monkeypatch, _Faults(), policy_dies=True)
    err = capsys.readouterr().err
    assert code == 4, err
    assert "Traceback" not in err
    message = err[err.index("mrl: run failed:"):]
    assert "worker group 'policy' rank 0" in message and "died while running 'PolicyWorker.__init__'" in message
    assert "starts it again from the beginning" in message


class _Always(set):
    """Fault points that strike every call of one method (a start that always fails)."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self.method = method

    def __contains__(self, point: object) -> bool:
        return isinstance(point, tuple) and point[0] == self.method

    def discard(self, point: Any) -> None:
        pass
