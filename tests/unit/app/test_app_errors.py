"""A failure that re-running cannot cure never says to re-run: a worker's failure that comes from the configuration
(mrl/app/errors.py `configuration_failure`) ends the command as a configuration error with the fix, while any other
worker failure keeps the advice to re-run (mrl/app/commands.py `explained_failures`). No worker starts: the errors
are made by hand as a worker group raises them."""

from __future__ import annotations

import pytest

from mrl.app.commands import explained_failures
from mrl.app.errors import RunFailed, configuration_failure
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.distributed.errors import WorkerError

VLLM_CPU = ("worker group 'generation' rank 0 (node 192.0.2.2, pid 10296) raised RuntimeError in 'generate_shard': "
            "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0")


def _raised(message: str, cause: BaseException | None = None) -> WorkerError:
    trace = "Traceback (most recent call last):\n  File \"vllm/...\", line 1\nRuntimeError: ..."
    return WorkerError(f"{message}\n--- remote traceback ---\n{trace}", group="generation", rank=0,
                       method="generate_shard", cause=cause, remote_traceback=trace)


def _cfg(tmp_path) -> MrlConfig:
    return MrlConfig.model_validate({"checkpointing": {"dir": str(tmp_path / "ckpt")}})


def test_a_cpu_attention_failure_ends_as_a_configuration_error_without_advice_to_rerun(tmp_path):
    with pytest.raises(ConfigError) as err, explained_failures(_cfg(tmp_path)):
        raise _raised(VLLM_CPU)
    text = err.value.render()
    assert text.startswith("policy.model_name: worker group 'generation' rank 0")
    assert "head_dim=16" in text and "a re-run fails the same way" in text and "generation.backend=megatron" in text
    assert "remote traceback" not in text and "resumes" not in text and "starts it again" not in text


def test_a_config_error_a_worker_raised_is_that_error():
    raised = ConfigError("not served", key="generation.vllm.max_model_len")
    assert configuration_failure(_raised("worker group 'generation' rank 0 raised ConfigError", raised)) is raised


def test_any_other_worker_failure_still_says_where_a_rerun_resumes(tmp_path):
    with pytest.raises(RunFailed) as err, explained_failures(_cfg(tmp_path)):
        raise _raised("worker group 'policy' rank 1 raised RuntimeError in 'train': CUDA error: an illegal address")
    assert "starts it again from the beginning" in str(err.value)  # no checkpoint yet: a re-run may well pass


def test_only_workers_failures_are_read():
    assert configuration_failure(RuntimeError("Unsupported CPU attention configuration: head_dim=16")) is None


def test_an_engine_start_that_fails_from_the_configuration_is_a_configuration_error(tmp_path, monkeypatch):
    """`start_runtime` as a failing engine start leaves it: the cluster shut down, then the configuration error."""
    from mrl.app import runtime
    from mrl.testing.tiny_models import build_tiny_hf_model

    model = build_tiny_hf_model(tmp_path / "model", hidden=64, heads=2, layers=1, intermediate=64)
    stopped = []

    class Cluster:
        def shutdown(self) -> None:
            stopped.append(True)

    def failing_start(cfg, cluster):
        raise _raised(VLLM_CPU)

    monkeypatch.setattr(runtime.RayCluster, "from_config", staticmethod(lambda config: Cluster()))
    monkeypatch.setattr(runtime, "reserve_placement", failing_start)
    cfg = MrlConfig.model_validate({"policy": {"model_name": str(model), "max_total_sequence_length": 256},
                                    "generation": {"max_new_tokens": 64}})  # within the model's 256 positions
    with pytest.raises(ConfigError, match="a re-run fails the same way"):
        runtime.start_runtime(cfg, total_steps=1, policy=False)
    assert stopped == [True]
