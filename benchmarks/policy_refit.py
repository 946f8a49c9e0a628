#!/usr/bin/env python
"""Refit from the sharded Megatron policy (Ray actors) into a vLLM engine (Ray actor), repeated: time per refit and
the engine's memory (USS of its process) drift, for both transports.

    colocated      policy TP2 on bundles 0-1, engine sharing bundle 0: buckets as shared-memory files
    non-colocated  policy TP1 on bundle 0, engine on bundle 1: buckets broadcast in a gloo group (collective)
    moe-ep1        a Qwen3-MoE policy on bundles 0-1 (2 data-parallel replicas, every expert on each), colocated
    moe-ep2        the same with its experts split over 2 expert-parallel ranks (gathered over EP for the refit)

Each refit gathers the policy's shards into HF tensors bucket by bucket and the engine reloads every layer. The bar this
project holds it to: engine memory within 5% over 50 refits.

    python benchmarks/policy_refit.py [--refits 50 --warmup 5 --hidden 512 --layers 8 --bucket-mb 16]
    python benchmarks/policy_refit.py --layouts moe-ep1,moe-ep2 [--experts 16] [--export-only]

`--export-only` (colocated layouts): the policy's side alone, each bucket packed into shared-memory files and
removed, no engine: what the sender costs where the engine's load does not hide it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _run(layout: str, model_dir: str, args: argparse.Namespace) -> None:
    from mrl.config.schema import ParallelConfig, PolicyConfig
    from mrl.distributed import RayCluster
    from mrl.inference import refit
    from mrl.inference.transports import SharedMemoryFileTransport, collective
    from mrl.inference.vllm_backend import VllmEngineConfig
    from mrl.inference.vllm_worker import VllmEngineGroup
    from mrl.policy.group import Policy
    from mrl.policy.worker import PolicySpec

    colocated = layout != "non-colocated"
    parallel = {"colocated": dict(tensor_parallel_size=2), "non-colocated": {},
                "moe-ep1": {}, "moe-ep2": dict(expert_parallel_size=2)}[layout]
    cluster = RayCluster(num_cpus=2)
    try:
        placement = cluster.create_placement("refit", bundles_per_node=2, cpus_per_bundle=1)
        cfg = PolicyConfig(precision="float32", parallel=ParallelConfig(**parallel))
        policy = Policy(PolicySpec(model_dir, cfg, seed=0, total_steps=1), placement, world_size=2 if colocated else 1,
                        resource_fraction=0.5 if colocated else 1.0)
        if args.export_only:
            _export_only(layout, policy, args)
            policy.shutdown()
            return
        engine = VllmEngineGroup(
            VllmEngineConfig(model_path=model_dir, max_model_len=128, kv_cache_bytes=64 << 20,
                             refit_transport="shm_file"),
            placement, bundle_indices=[0 if colocated else 1], resource_fraction=0.5 if colocated else 1.0)
        transport = SharedMemoryFileTransport() if colocated else collective.connect(policy, engine)
        bucket = int(args.bucket_mb * 2**20)
        for _ in range(args.warmup):
            refit(policy, engine, transport, bucket_bytes=bucket)
        before = sum(engine.worker_uss_bytes()[0])
        times = []
        for _ in range(args.refits):
            start = time.perf_counter()
            stats = refit(policy, engine, transport, bucket_bytes=bucket)
            times.append(time.perf_counter() - start)
        after = sum(engine.worker_uss_bytes()[0])
        print(f"{layout:13s} ({transport.kind}): {args.refits} refits of {stats.bytes / 2**20:.1f} MiB in "
              f"{stats.num_buckets} buckets: mean {1000 * statistics.mean(times):.0f} ms, max "
              f"{1000 * max(times):.0f} ms; engine USS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB "
              f"({100 * (after - before) / before:+.1f}%)", flush=True)
        engine.shutdown()
        policy.shutdown()
    finally:
        cluster.shutdown()


def _export_only(layout: str, policy, args: argparse.Namespace) -> None:
    """Every bucket exported and packed by the policy's ranks into shared-memory files, then removed."""
    from mrl.inference.transports import SharedMemoryFileTransport

    transport, bucket, times = SharedMemoryFileTransport(), int(args.bucket_mb * 2**20), []
    for refit_index in range(args.warmup + args.refits):
        start, moved = time.perf_counter(), 0
        for index in policy.plan_buckets(bucket):
            payload = policy.send_bucket(index, transport)
            moved += payload["bytes"]
            transport.release(payload)
        if refit_index >= args.warmup:
            times.append(time.perf_counter() - start)
    print(f"{layout:13s} export only: {args.refits} exports of {moved / 2**20:.1f} MiB: mean "
          f"{1000 * statistics.mean(times):.0f} ms, max {1000 * max(times):.0f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refits", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=16)
    parser.add_argument("--layouts", default="colocated,non-colocated")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer of the MoE layouts")
    parser.add_argument("--export-only", action="store_true", help="the policy's export alone, no engine")
    args = parser.parse_args()

    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        dense = str(build_tiny_hf_model(f"{tmp}/dense", hidden=args.hidden, layers=args.layers, heads=8,
                                        num_kv_heads=4, intermediate=4 * args.hidden))
        moe = str(build_tiny_hf_model(f"{tmp}/moe", "qwen3_moe", hidden=args.hidden, layers=args.layers, heads=8,
                                      num_kv_heads=4, intermediate=4 * args.hidden, num_experts=args.experts,
                                      moe_intermediate_size=args.hidden))
        for layout in args.layouts.split(","):
            _run(layout, moe if layout.startswith("moe") else dense, args)


if __name__ == "__main__":
    main()
