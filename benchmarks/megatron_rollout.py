"""Rollout throughput of mrl's Megatron backend, its static loop against its dynamic engine, and the dynamic engine
bare (megatron-core's own sampler and request loop), on the same prompts and model in one process.

    static : MegatronBackend(engine="static").generate(rows, SamplingConfig)    -- static batches by prompt length
    dynamic: MegatronBackend(engine="dynamic").generate(rows, SamplingConfig)   -- in-flight batching, paged KV
    bare   : DynamicInferenceEngine over the same model, SamplingParams(temperature 1, return_log_probs), requests
             added and stepped until done                                     -- nothing of mrl around it
Every response has exactly --tokens tokens (no stop set), so the three generate the same number of tokens. Prints
generated tokens/s of each (median over reps; the first call of each, which builds its engine, is not counted) and
the ratios dynamic / static and dynamic / bare; with --profile on CUDA, each path's host synchronisations.

    python benchmarks/megatron_rollout.py [--prompts 64 --n 4 --tokens 32 --reps 3 --hidden 128 --layers 2]
    (a GPU session's `rollout` stage: --hidden 1024 --layers 28 --tokens 256 --dtype bfloat16 --block 256)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

from gpu_policy_throughput import host_syncs  # benchmarks/ is on sys.path
from rollout_throughput import _prompts  # the same prompts as the vLLM benchmark

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=16, help="tokens per KV block of the dynamic engine")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="bfloat16 on a GPU")
    parser.add_argument("--profile", action="store_true",
                        help="on CUDA, after the timed reps: each path's host synchronisations in one call, per "
                             "decode step and by source line (torch.cuda.set_sync_debug_mode)")
    return parser.parse_args()


def _bare(backend, rows: list[list[int]], tokens: int) -> Callable[[], int]:
    """megatron-core's dynamic engine over `backend`'s model, as its own example drives it."""
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from mrl.inference.megatron_backend import _TokenIdTokenizer, _UnpaddedLogitsWrapper

    loop = backend.dynamic
    loop.engine = loop._build()  # the same context sizes as mrl's; megatron's own controller and sampler below
    engine = loop.engine
    engine.controller = TextGenerationController(
        _UnpaddedLogitsWrapper(backend.model, engine.context, backend.vocab_size), _TokenIdTokenizer()
    )
    engine.suspend()

    def run() -> int:
        engine.resume()
        try:
            engine.reset()
            params = SamplingParams(
                temperature=1.0,
                return_log_probs=True,
                skip_prompt_log_probs=True,
                num_tokens_to_generate=tokens,
                termination_id=-1,
            )
            for i, ids in enumerate(rows):
                engine.add_request(i, ids, params)
            done = 0
            while engine.has_unfinished_requests():
                done += sum(len(r.merge().generated_tokens) for r in engine.step_modern()["finished_request_records"])
        finally:
            engine.suspend()
        return done

    return run


def main() -> None:
    args = _parse()
    import torch  # after OMP_NUM_THREADS is set
    from mrl.inference import SamplingConfig
    from mrl.inference.megatron_backend import MegatronBackend, MegatronEngineConfig
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        model = build_tiny_hf_model(
            os.path.join(root, "model"),
            "qwen2",
            hidden=args.hidden,
            heads=args.hidden // 32,
            num_kv_heads=max(1, args.hidden // 64),
            intermediate=2 * args.hidden,
            layers=args.layers,
        )
        prompts = _prompts(args.prompts, 400)
        rows = [p for p in prompts for _ in range(args.n)]
        sampling = SamplingConfig(n=args.n, max_new_tokens=args.tokens, ignore_eos=True, logprobs=True, seed=0)
        max_len = 24 + args.tokens
        engines = {
            loop: MegatronBackend(
                MegatronEngineConfig(
                    str(model),
                    max_model_len=max_len,
                    max_batch_size=64,
                    engine=loop,
                    kv_block_tokens=args.block,
                    dtype=args.dtype,
                )
            )
            for loop in ("static", "dynamic")
        }
        bare_engine = MegatronBackend(
            MegatronEngineConfig(
                str(model),
                max_model_len=max_len,
                max_batch_size=64,
                engine="dynamic",
                kv_block_tokens=args.block,
                dtype=args.dtype,
            )
        )
        paths: dict[str, Callable[[], int]] = {
            loop: (lambda e=engine: sum(s.length for s in e.generate(prompts, sampling).samples))
            for loop, engine in engines.items()
        }
        paths["bare"] = _bare(bare_engine, rows, args.tokens)
        times: dict[str, list[float]] = {name: [] for name in paths}
        generated: dict[str, int] = {}
        for rep in range(args.reps + 1):
            for name, run in paths.items():
                start = time.perf_counter()
                generated[name] = run()
                if rep:  # the first call of each builds its engine
                    times[name].append(time.perf_counter() - start)
        print(
            f"{len(rows)} rows ({args.prompts} prompts x {args.n}), {args.tokens} tokens each, hidden {args.hidden}, "
            f"{args.layers} layers, KV blocks of {args.block} tokens, {args.dtype}, {args.reps} reps"
        )
        rate = {name: generated[name] / statistics.median(times[name]) for name in paths}
        for name in paths:
            print(
                f"  {name:8} {generated[name]:6d} tokens  {statistics.median(times[name]):7.3f} s  "
                f"{rate[name]:9.0f} tokens/s"
            )
        print(
            f"  dynamic / static {rate['dynamic'] / rate['static']:.2f}, dynamic / bare "
            f"{rate['dynamic'] / rate['bare']:.2f}"
        )
        if args.profile and torch.cuda.is_available():
            for name, run in paths.items():
                sites = host_syncs(run)
                print(
                    f"  {name}: {sum(sites.values())} host synchronisations in one call, "
                    f"{sum(sites.values()) / args.tokens:.1f} per decode step; by site: {dict(sites.most_common(8))}"
                )


if __name__ == "__main__":
    main()
