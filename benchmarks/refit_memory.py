"""Repeated refits into one vLLM engine: time per refit and process memory (USS) drift.

Alternates two weight sets (so every refit really changes the weights) `--refits` times after `--warmup` refits,
for the in-process transport and the shared-memory file transport, on an in-process engine each (USS of this
process is the engine's). Prints mean/max refit time, buckets, and USS before -> after. The bar this project holds it to:
USS within 5%.

    python benchmarks/refit_memory.py [--refits 50 --hidden 512 --layers 8 --bucket-mb 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refits", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=16)
    args = parser.parse_args()

    from safetensors.torch import load_file

    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig
    from mrl.inference.vllm_extension import process_uss_bytes
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        kw = dict(hidden=args.hidden, heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 64),
                  intermediate=2 * args.hidden, layers=args.layers)
        paths = [build_tiny_hf_model(os.path.join(root, name), "qwen2", seed=seed, **kw)
                 for seed, name in enumerate(("a", "b"))]
        states = [load_file(str(path / "model.safetensors")) for path in paths]
        size = sum(t.numel() * t.element_size() for t in states[0].values())
        print(f"model: hidden {args.hidden}, {args.layers} layers, {size / 2**20:.1f} MiB fp32; "
              f"buckets <= {args.bucket_mb:g} MiB")
        for transport in ("in_process", "shm_file"):
            backend = VllmBackend(VllmEngineConfig(
                model_path=str(paths[0]), max_model_len=128, kv_cache_bytes=64 << 20, refit_transport=transport,
                refit_bucket_bytes=int(args.bucket_mb * 2**20),
            ))
            for i in range(args.warmup):
                backend.update_weights(states[i % 2].items())
            start = process_uss_bytes()
            stats = [backend.update_weights(states[i % 2].items()) for i in range(args.refits)]
            end = process_uss_bytes()
            times = [1000 * s.seconds for s in stats]
            print(f"{transport:>10}: {args.refits} refits, {stats[0].num_buckets} buckets of <= "
                  f"{stats[0].max_bucket_bytes / 2**20:.1f} MiB, refit {sum(times) / len(times):.1f} ms mean / "
                  f"{max(times):.1f} ms max; USS {start / 2**20:.0f} -> {end / 2**20:.0f} MiB "
                  f"({(end - start) / start:+.2%})")
            backend.shutdown()


if __name__ == "__main__":
    main()
