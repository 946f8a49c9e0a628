"""Colocated, the refit hands the memory of both trainable groups over before the engine wakes: the policy's and
PPO's critic's optimizer states and gradients (mrl/app/runtime.py `Runtime._refit_once`); an engine on devices of its
own takes nothing from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.app import runtime as runtime_module
from mrl.app.model_source import ModelSource
from mrl.config import load_config
from mrl.inference.refit import RefitStats

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-cpu.yaml"


class _Group:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def release_memory(self) -> dict[str, float]:
        self.log.append(f"{self.name} released")
        return {}


@pytest.mark.parametrize("colocated", [True, False])
def test_the_refit_hands_the_critics_memory_over_with_the_policys_when_colocated(monkeypatch, tmp_path, colocated):
    log: list[str] = []
    extra = [] if colocated else ["generation.colocated=false", "generation.num_devices=1", "cluster.devices_per_node=2"]
    cfg = load_config(RECIPE, ["stages=[]", "grpo.advantage_estimator=gae", f"run.output_dir={tmp_path}", *extra])

    def refit(policy, engine, transport, **kwargs) -> RefitStats:
        log.append("refit")
        return RefitStats(1, 1, 8, 8, 0.0)

    monkeypatch.setattr(runtime_module, "refit", refit)
    run = runtime_module.Runtime(cfg, ModelSource(tmp_path), tokenizer=None, cluster=None)  # type: ignore[arg-type]
    run.policy, run.critic, run.engine = _Group("policy", log), _Group("critic", log), object()  # type: ignore
    monkeypatch.setattr(run, "_transport", lambda: None)
    run.refit()
    assert log == (["policy released", "critic released", "refit"] if colocated else ["refit"])
