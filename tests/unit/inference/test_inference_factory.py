"""Config tree -> sampling and engine settings."""

import pytest

from mrl.config.schema import MrlConfig
from mrl.inference.factory import STEP_SEED_STRIDE, num_generation_engines, sampling_config, vllm_engine_config


def _cfg(**tree) -> MrlConfig:
    return MrlConfig.model_validate(tree)


def test_sampling_follows_the_generation_section_and_moves_the_seed_per_step():
    cfg = _cfg(
        run={"seed": 3},
        grpo={"num_generations_per_prompt": 4, "num_prompts_per_step": 64},
        generation={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33, "stop_token_ids": [7],
                    "stop_strings": ["</answer>"], "overlong_prompt": "truncate"},
    )
    s = sampling_config(cfg, step=2)
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (4, 0.7, 0.9, 20, 33)
    assert s.stop_token_ids == (7,) and s.stop_strings == ("</answer>",) and s.overlong_prompt == "truncate"
    assert s.seed == 3 + 2 * STEP_SEED_STRIDE and s.logprobs


def test_validation_samples_with_the_eval_count_and_temperature_and_generation_s_other_settings():
    cfg = _cfg(
        run={"seed": 3},
        eval={"num_samples": 5, "temperature": 0.0, "pass_k": [1, 5]},
        generation={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33, "stop_token_ids": [7],
                    "stop_strings": ["</answer>"], "overlong_prompt": "truncate"},
    )
    s = sampling_config(cfg, step=9, purpose="eval")
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (5, 0.0, 0.9, 20, 33)
    assert s.stop_token_ids == (7,) and s.stop_strings == ("</answer>",) and s.overlong_prompt == "truncate"
    assert s.seed == sampling_config(cfg, step=1, purpose="eval").seed  # the same problems, the same draws


def test_engine_settings():
    cfg = _cfg(policy={"precision": "float32", "max_total_sequence_length": 300},
               generation={"max_new_tokens": 100, "refit_bucket_mb": 8, "vllm": {"kv_cache_gib": 0.5}})
    e = vllm_engine_config(cfg, "some/model")
    assert (e.model_path, e.dtype, e.max_model_len, e.kv_cache_bytes) == ("some/model", "float32", 300, 2**29)
    assert e.refit_bucket_bytes == 8 * 2**20 and e.refit_transport == "shm_file" and not e.multiprocessing
    assert vllm_engine_config(_cfg(generation={"vllm": {"max_model_len": 128}}), "m").max_model_len == 128


def test_number_of_engines():
    assert num_generation_engines(_cfg(cluster={"devices_per_node": 4})) == 4
    assert num_generation_engines(
        _cfg(cluster={"devices_per_node": 4}, generation={"vllm": {"tensor_parallel_size": 2}})
    ) == 2
    assert num_generation_engines(_cfg(cluster={"devices_per_node": 4, "num_nodes": 2}, generation={
        "vllm": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})) == 2  # 8 devices, engines of 2 x 2
    with pytest.raises(ValueError, match="pipeline_parallel_size = 3 does not divide the 4 devices"):
        num_generation_engines(_cfg(cluster={"devices_per_node": 4}, generation={"vllm": {"tensor_parallel_size": 3}}))


def test_cpu_engines_of_several_workers_split_the_cores_they_may_use():
    """vLLM's "auto" binding wants a NUMA node per worker and refuses TP or PP 2 on a one-NUMA machine, so mrl
    resolves it: even consecutive shares of the process's cores (mrl.cpu.vllm_workarounds.cpu_threads_bind_for)."""
    from mrl.cpu.vllm_workarounds import cpu_threads_bind_for

    assert cpu_threads_bind_for(2, [0, 1]) == "0|1"
    assert cpu_threads_bind_for(2, [3, 0, 1, 2, 4]) == "0,1|2,3,4"  # sorted; the remainder to the last
    assert cpu_threads_bind_for(4, [6, 7]) == "6|7|6|7"  # fewer cores than workers: round robin
    assert cpu_threads_bind_for(1, [0, 1, 2]) == "0,1,2"
