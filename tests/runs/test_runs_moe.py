"""The tiny mixture-of-experts recipe through the real command line: GRPO with a Qwen3-MoE policy whose experts are
split over 2 expert-parallel ranks, rollouts from vLLM or from Megatron's dynamic engine, each refitted from the
EP-sharded policy after every step: the engine's logprobs of its own samples equal the trainer's
(token_mult_prob_error <= 1.001 on every step) and every step reports its expert load.

Shortened as the dense end-to-end tests are (1-digit task, a few steps, from the random initial model). Whole runs
(a minute and a half through vLLM): in `make test-runs`, out of `make test`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.testing.runs import MACHINERY, finish, metrics, mrl

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "arith-tiny-moe-cpu.yaml")
SHORT = ("data.arith.digits=1", "data.arith.num_heldout=20", "grpo.max_num_steps=3", "grpo.max_num_epochs=4",
         "grpo.val_every=0", "eval.num_samples=2", "eval.pass_k=[1,2]", "policy.max_total_sequence_length=12",
         "generation.max_new_tokens=4", "generation.vllm.max_model_len=12", "checkpointing.enabled=false", *MACHINERY)


@pytest.mark.parametrize("backend", ["vllm", "megatron"])
def test_moe_grpo_engine_matches_trainer_on_every_step(tmp_path, backend):
    """With Megatron's engine (its dynamic engine: in-flight batching) the run also replays the engine's routing
    (policy.moe.router_replay=replay: vLLM returns it on CUDA only): the routing travels from the engine through the
    rollouts to the EP2 trainer, whose own choices agree with the engine's on every token (same fp32 weights) and are
    logged per MoE layer."""
    replay = ["policy.moe.router_replay=replay", "generation.megatron.engine=dynamic"] if backend == "megatron" else []
    finish(mrl("grpo", "--config", RECIPE, *SHORT, f"run.output_dir={tmp_path}", f"generation.backend={backend}",
               *replay))
    logged = metrics(tmp_path / "logs")
    assert sorted(logged) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert logged[step]["train/token_mult_prob_error"] <= 1.001, (step, logged[step])
        assert logged[step]["train/expert_load_max_over_mean"] >= 1.0
        if replay:
            per_layer = {k: v for k, v in logged[step].items() if k.startswith("train/moe_routing_differs/layer_")}
            assert len(per_layer) == 4 and logged[step]["train/moe_routing_differs_max"] <= 0.01, logged[step]  # 4 layers
        assert logged[step]["train/refit_bytes"] > 0
