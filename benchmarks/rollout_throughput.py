"""Rollout throughput through mrl's vLLM backend vs bare vLLM, on the same prompts and settings.

Default: both paths drive ONE in-process engine, interleaved rep by rep, so the ratio isolates mrl's overhead
(prompt fitting, per-prompt seeded SamplingParams, typed samples with per-token logprobs):
  bare: llm.generate(TokensPrompt list, one SamplingParams(n, max_tokens, ignore_eos, logprobs=0, seed,
        detokenize=False))                                     -- raw vLLM RequestOutputs, nothing extracted
  mrl : VllmBackend.generate(token id lists, SamplingConfig)   -- GenerationOutput with logprobs per token
--via-ray: the mrl path goes through VllmEngineGroup (one engine in a Ray actor: controller -> actor -> engine ->
  samples back to the controller), the bare path through an engine with the same settings in this process.
Prints generated tokens/s of each (median over reps) and mrl / bare.

    python benchmarks/rollout_throughput.py [--prompts 64 --n 4 --tokens 64 --reps 5 --hidden 128 --layers 2]
--model DIR takes an HF folder instead of the tiny Qwen2, e.g. the real SmolLM2-135M-Instruct of `make real` with
#38's workload (16 samples x 64 tokens):
    python benchmarks/rollout_throughput.py --model .cache/real/smollm2-135m-instruct --prompts 4 --n 4 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _prompts(count: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts of 8..23 tokens."""
    return [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(8 + i % 16)] for i in range(count)]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--via-ray", action="store_true", help="mrl path through a one-engine Ray actor group")
    parser.add_argument("--model", metavar="DIR", help="an HF model folder instead of the tiny Qwen2")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        model = os.path.abspath(args.model) if args.model else build_tiny_hf_model(
            os.path.join(root, "model"), "qwen2", hidden=args.hidden, heads=args.hidden // 32,
            num_kv_heads=max(1, args.hidden // 64), intermediate=2 * args.hidden, layers=args.layers,
        )
        config = VllmEngineConfig(model_path=str(model), max_model_len=256, kv_cache_bytes=1 << 30)
        prompts = _prompts(args.prompts, 400)  # ids below 400: in every vocabulary
        backend = VllmBackend(config)
        cleanup: Callable[[], None] = backend.shutdown
        mrl_backend = backend
        if args.via_ray:
            mrl_backend, cleanup = _ray_group(config, backend)
        run_bare, run_mrl = _bare_runner(backend, prompts, args), _mrl_runner(mrl_backend, prompts, args)
        run_bare(), run_mrl()  # warm-up with the same shapes
        bare, mrl = [], []
        for _ in range(args.reps):
            bare.append(run_bare())
            mrl.append(run_mrl())
        cleanup()
    b, m = statistics.median(bare), statistics.median(mrl)
    shape = os.path.basename(os.path.normpath(args.model)) if args.model else \
        f"hidden {args.hidden}, {args.layers} layers"
    print(f"settings: {args.prompts} prompts x n={args.n} x {args.tokens} tokens, {shape}, fp32, logprobs on, "
          f"{args.reps} reps (median), mrl path "
          f"{'through a Ray actor' if args.via_ray else 'in-process, same engine'}")
    print(f"bare vLLM : {b:8.0f} tok/s   reps {[round(x) for x in bare]}")
    print(f"mrl       : {m:8.0f} tok/s   reps {[round(x) for x in mrl]}")
    print(f"ratio mrl / bare = {m / b:.3f}")


def _ray_group(config, backend):
    from mrl.distributed import RayCluster
    from mrl.inference.vllm_worker import VllmEngineGroup

    cluster = RayCluster(num_cpus=1)
    group = VllmEngineGroup(config, cluster.create_placement("bench", bundles_per_node=1, cpus_per_bundle=1))

    def cleanup() -> None:
        group.shutdown()
        cluster.shutdown()
        backend.shutdown()

    return group, cleanup


def _bare_runner(backend, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=1,
                            detokenize=False)

    def run() -> float:
        start = time.perf_counter()
        outputs = backend.llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed

    return run


def _mrl_runner(backend, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[], float]:
    from mrl.inference import SamplingConfig

    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True, seed=1)

    def run() -> float:
        start = time.perf_counter()
        out = backend.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        return sum(s.length for s in out.samples) / elapsed

    return run


if __name__ == "__main__":
    main()
