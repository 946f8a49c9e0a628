"""Megatron backend against HF transformers on the same weights (tiny Qwen2, GQA, fp32, CPU), with each of its
loops: Megatron's static batches and its dynamic engine (in-flight batching over a paged KV cache).

The reference is an independent implementation: an HF forward over prompt + sampled tokens gives the logprob of
every sampled token; HF `generate` gives greedy continuations. The vocabulary (500) is padded to 512 by Megatron,
prompts of different lengths share static batches, and there are more rows than one batch holds, so the padding,
the KV-cached decode steps and the scheduler's batching are all exercised; the dynamic engine's KV blocks (16
tokens) are smaller than a prompt and its response, so its requests cross blocks.
"""

from __future__ import annotations

import pytest
import torch

from mrl.inference import FinishReason, GenerationBackend, SamplingConfig
from mrl.inference.refit import RefitError
from mrl.testing.tiny_models import build_tiny_hf_model

TOL = 1e-4
MAX_MODEL_LEN = 48
PROMPTS = [[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4, 250, 31], [7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "qwen2", num_kv_heads=2, seed=3)


@pytest.fixture(scope="module", params=["static", "dynamic"])
def backend(model_dir, request):
    from mrl.parallel.groups import destroy_process_groups

    engine = _engine(model_dir, request.param)
    yield engine
    destroy_process_groups()


def _engine(path, loop: str):
    from mrl.inference.megatron_backend import MegatronBackend, MegatronEngineConfig

    return MegatronBackend(MegatronEngineConfig(str(path), max_model_len=MAX_MODEL_LEN, max_batch_size=5, engine=loop,
                                                kv_block_tokens=16))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_t | prompt, tokens_<t) from one HF forward, [len(tokens)]."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()  # [T, V]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def max_logprob_error(hf_model, output) -> float:
    worst = 0.0
    for sample in output.samples:
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        ref = hf_logprobs(hf_model, sample.prompt_token_ids, sample.token_ids)
        worst = max(worst, (torch.tensor(sample.logprobs) - ref).abs().max().item())
    return worst


def test_is_a_generation_backend(backend):
    from megatron.core.inference.utils import InferenceMode

    assert isinstance(backend, GenerationBackend)
    backend.prepare_for_generation()
    backend.generate(PROMPTS, SamplingConfig(max_new_tokens=2))
    backend.finish_generation()
    assert not InferenceMode.is_active()  # a training forward may follow in this process (the dynamic engine's)
    if backend.config.engine == "dynamic":  # a KV slot per attention layer, none for the HybridModel's MLP layers
        context = backend.dynamic.engine.context
        layers = len(backend.model.decoder.layers) // 2  # a transformer layer is an attention and an MLP layer
        assert context.num_attention_layers == layers
        assert context.layer_map == {2 * i: i for i in range(layers)}


def test_sampled_token_logprobs_equal_hf(backend, hf_model):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=0, ignore_eos=True)
    out = backend.generate(PROMPTS, sampling)
    assert len(out.samples) == len(PROMPTS) * 3
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [(i, k) for i in range(4) for k in range(3)]
    assert all(s.prompt_token_ids == PROMPTS[s.prompt_index] for s in out.samples)
    assert all(s.length == 12 and s.finish_reason is FinishReason.LENGTH for s in out.samples)
    assert all(max(s.token_ids) < 500 for s in out.samples)  # never a padded-vocabulary id
    assert len({tuple(s.token_ids) for s in out.samples}) > len(PROMPTS)  # samples of a prompt differ
    error = max_logprob_error(hf_model, out)
    print(f"max |engine - HF| logprob, sampled: {error:.2e}")
    assert error <= TOL


def test_logprobs_are_raw_whatever_the_sampling_filters(backend, hf_model):
    sampling = SamplingConfig(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, seed=1, ignore_eos=True)
    assert max_logprob_error(hf_model, backend.generate(PROMPTS, sampling)) <= TOL


def test_greedy_equals_hf_generate(backend, hf_model):
    out = backend.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    for prompt, sample in zip(PROMPTS, out.samples):
        ids = torch.tensor([prompt])
        reference = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                      min_new_tokens=10, pad_token_id=0)
        assert sample.token_ids == reference[0, len(prompt):].tolist()
    assert max_logprob_error(hf_model, out) <= TOL


def test_stop_tokens_end_a_response_and_are_kept(backend):
    free = backend.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    stop = free.samples[0].token_ids[3]  # a token greedy decoding of prompt 0 emits at step 4
    out = backend.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,),
                                                   ignore_eos=True))
    for unstopped, sample in zip(free.samples, out.samples):
        if stop in unstopped.token_ids:
            cut = unstopped.token_ids.index(stop) + 1
            assert sample.token_ids == unstopped.token_ids[:cut] and sample.finish_reason is FinishReason.STOP
            assert sample.logprobs == pytest.approx(unstopped.logprobs[:cut], abs=1e-6)
        else:
            assert sample.token_ids == unstopped.token_ids and sample.finish_reason is FinishReason.LENGTH
    assert out.samples[0].length == 4


def test_eos_ends_a_response_unless_ignored(backend, tmp_path):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    free = backend.generate(PROMPTS, greedy)
    eos = free.samples[0].token_ids[3]
    # The same weights (same seed) with that token as config.json's EOS: random weights rarely emit the real one.
    eos_dir = build_tiny_hf_model(tmp_path, "qwen2", num_kv_heads=2, seed=3, eos_token_id=eos)
    engine = _engine(eos_dir, backend.config.engine)
    assert eos in engine.eos_ids
    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10))
    for unstopped, sample in zip(free.samples, out.samples):
        cut = unstopped.token_ids.index(eos) + 1 if eos in unstopped.token_ids else 10
        assert sample.token_ids == unstopped.token_ids[:cut]
        assert sample.finish_reason is (FinishReason.STOP if cut < 10 or eos == sample.token_ids[-1]
                                        else FinishReason.LENGTH)
    assert out.samples[0].length == 4 and out.samples[0].finish_reason is FinishReason.STOP
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] == [s.token_ids for s in free.samples]


def test_seeded_calls_reproduce(backend):
    sampling = SamplingConfig(n=2, max_new_tokens=6, seed=11, ignore_eos=True)
    first, again = backend.generate(PROMPTS, sampling), backend.generate(PROMPTS, sampling)
    other = backend.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=6, seed=12, ignore_eos=True))
    tokens = lambda out: [s.token_ids for s in out.samples]  # noqa: E731
    assert tokens(first) == tokens(again) and tokens(first) != tokens(other)


def test_overlong_prompts_are_rejected_or_truncated(backend, hf_model):
    long_prompt = list(range(3, 3 + 45))  # limit = 48 - 8 = 40 tokens
    reject = backend.generate([PROMPTS[0], long_prompt], SamplingConfig(n=2, max_new_tokens=8, seed=0))
    assert reject.num_prompts_rejected == 1 and reject.num_prompts_truncated == 0
    assert [s.finish_reason for s in reject.samples[2:]] == [FinishReason.ABORTED] * 2
    assert all(s.token_ids == [] and s.logprobs == [] for s in reject.samples[2:])
    truncate = backend.generate([long_prompt], SamplingConfig(max_new_tokens=8, seed=0, ignore_eos=True,
                                                              overlong_prompt="truncate"))
    sample = truncate.samples[0]
    assert truncate.num_prompts_truncated == 1 and sample.prompt_truncated
    assert sample.prompt_token_ids == long_prompt[-40:] and sample.length == 8
    assert max_logprob_error(hf_model, truncate) <= TOL
    with pytest.raises(ValueError, match="stop_token_ids"):
        backend.generate(PROMPTS, SamplingConfig(stop_strings=("</answer>",)))


def test_refit_lands_and_a_partial_refit_is_rejected(backend, hf_model, model_dir):
    from converters.hf_io import load_hf_state

    original = load_hf_state(model_dir)
    noise = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=noise) for k, v in original.items()}
    sampling = SamplingConfig(n=2, max_new_tokens=10, seed=4, ignore_eos=True)
    try:
        stats = backend.update_weights(iter(sorted(perturbed.items())))  # a stream, in any order
        assert stats.num_tensors == len(perturbed) and stats.bytes > 0
        out = backend.generate(PROMPTS, sampling)
        hf_model.load_state_dict(perturbed, strict=False)
        error = max_logprob_error(hf_model, out)
        print(f"max |engine - HF| logprob after refit: {error:.2e}")
        assert error <= TOL
        hf_model.load_state_dict(original, strict=False)
        assert max_logprob_error(hf_model, out) > 100 * TOL  # the refit changed the engine's distribution

        partial = {k: v for k, v in original.items() if "layers.1." not in k}
        with pytest.raises(RefitError, match="missing"):
            backend.update_weights(partial)
        hf_model.load_state_dict(perturbed, strict=False)  # the engine still holds the perturbed weights
        assert max_logprob_error(hf_model, backend.generate(PROMPTS, sampling)) <= TOL
    finally:
        backend.update_weights(original)
        hf_model.load_state_dict(original, strict=False)


def test_sampler_filters():
    from mrl.inference.megatron_backend import sample_next_tokens

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)  # [b, V]
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next_tokens(logits, 1.0, 2, 1.0, gen).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # top-p 0.8: tokens 0 and 1 hold 0.665 + 0.245 = 0.91, the smallest set >= 0.8
    assert probs[:1].sum() < 0.8 <= probs[:2].sum()
    assert set(sample_next_tokens(logits, 1.0, 0, 0.8, gen).tolist()) == {0, 1}
    assert set(sample_next_tokens(logits, 1.0, 0, 0.5, gen).tolist()) == {0}
    assert sample_next_tokens(logits, 0.0, 0, 1.0, gen).eq(0).all()
    counts = torch.bincount(sample_next_tokens(logits, 1.0, 0, 1.0, gen), minlength=5).float() / 2000
    torch.testing.assert_close(counts, probs, atol=0.04, rtol=0)


def test_factory_builds_the_megatron_backend_from_the_config(backend, model_dir):
    from mrl.config.schema import MrlConfig
    from mrl.inference.factory import build_generation, megatron_engine_config
    from mrl.inference.megatron_backend import MegatronBackend

    loop = {"engine": backend.config.engine, "kv_block_tokens": 16}
    cfg = MrlConfig.model_validate({"run": {"seed": 7},
                                    "generation": {"backend": "megatron", "max_new_tokens": 8, "megatron": loop},
                                    "policy": {"precision": "float32", "max_total_sequence_length": MAX_MODEL_LEN}})
    settings = megatron_engine_config(cfg, str(model_dir))
    assert (settings.max_model_len, settings.dtype, settings.seed) == (MAX_MODEL_LEN, "float32", 7)
    assert (settings.engine, settings.kv_block_tokens) == (backend.config.engine, 16)
    assert settings.compiled_fusions is None  # auto: decided where the engine runs
    cfg.policy.speed.compiled_fusions = False
    assert megatron_engine_config(cfg, str(model_dir)).compiled_fusions is False
    cfg.policy.speed.compiled_fusions = "auto"
    engine = build_generation(cfg, str(model_dir), placement=None)
    assert isinstance(engine, MegatronBackend)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] == \
        [s.token_ids for s in backend.generate(PROMPTS, greedy).samples]


def test_an_engine_started_from_a_config_alone_generates_once_refitted(backend, model_dir, tmp_path):
    """The engine of a run started from a Megatron checkpoint: config + tokenizer only, the weights by refit."""
    from converters.hf_io import copy_model_metadata, load_hf_state
    from mrl.config.schema import MrlConfig
    from mrl.inference.factory import build_generation

    config_only = tmp_path / "hf"
    copy_model_metadata(model_dir, config_only)
    loop = {"engine": backend.config.engine, "kv_block_tokens": 16}
    cfg = MrlConfig.model_validate({"generation": {"backend": "megatron", "max_new_tokens": 8, "megatron": loop},
                                    "policy": {"precision": "float32", "max_total_sequence_length": MAX_MODEL_LEN}})
    engine = build_generation(cfg, str(config_only), placement=None, load_weights=False)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    expected = [s.token_ids for s in backend.generate(PROMPTS, greedy).samples]
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] != expected  # random weights until then
    state = load_hf_state(model_dir)
    with pytest.raises(RefitError, match="missing"):
        engine.update_weights({k: v for k, v in state.items() if "layers.1." not in k})
    engine.update_weights(state)
    assert [s.token_ids for s in engine.generate(PROMPTS, greedy).samples] == expected


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_families_sample_with_transformers_logprobs(backend, tmp_path, family):
    """Qwen3-MoE and DeepSeek-V3 (MLA, its YaRN rope and latent KV in the KV-cached decode) in the same engine; the
    dynamic engine refuses multi-latent attention (its latent cache is not supported yet)."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_hf_model(tmp_path, family, layers=2, seed=1)
    if family == "deepseek_v3" and backend.config.engine == "dynamic":
        with pytest.raises(ValueError, match="multi-latent attention"):
            _engine(path, "dynamic")
        return
    engine = _engine(path, backend.config.engine)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager").eval()
    out = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, seed=3))
    assert max_logprob_error(hf, out) <= TOL


def test_the_compiled_fusions_sample_transformers_logprobs(backend, model_dir, hf_model, monkeypatch):
    """`policy.speed.compiled_fusions` (auto on a GPU) gives the engine megatron-core's fused SwiGLU and mrl's RoPE
    kernels (mrl/model/compiled_kernels.py): the static loop rotates whole batches (bshd), the dynamic engine its
    packed queries with a frequency per token. Forced here and run as written (torch.compile's force_eager stance):
    the same logprobs as HF."""
    from megatron.core.fusions import fused_bias_swiglu

    from mrl.model import build, compiled_kernels

    calls = []

    def rotate(t, freqs):
        calls.append("rope")
        return compiled_kernels.rotate(t, freqs)

    original_apply = fused_bias_swiglu.SwiGLUFunction.apply
    monkeypatch.setattr(build, "torch_compile_works_here", lambda: True)
    monkeypatch.setattr(compiled_kernels, "_compiled", rotate)
    monkeypatch.setattr(fused_bias_swiglu.SwiGLUFunction, "apply",
                        lambda *args: calls.append("swiglu") or original_apply(*args))
    with torch.compiler.set_stance("force_eager"):
        engine = _engine(model_dir, backend.config.engine)
        out = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=8, seed=3, ignore_eos=True))
    assert "rope" in calls and "swiglu" in calls
    assert max_logprob_error(hf_model, out) <= TOL
