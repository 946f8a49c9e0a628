#!/usr/bin/env python
"""The policy with LoRA (`policy.lora`) against full fine-tuning, on one model and batch: memory per parameter, train
step time, and what a refit moves.

Both paths are mrl's own (build_model, Megatron's DDP, build_optimizer, train_on_batch): `full` trains every
parameter, `lora` the adapters of mrl/model/lora.py on every linear (rank --rank, alpha 2 x rank), the base frozen.
Memory is read off the built objects, not estimated: the weights (every parameter), DDP's gradient buffers, and the
optimizer's state tensors after a step (Adam's two moments, and fp32 main weights when the model is bf16), each in
bytes per parameter of the base model. Step time: the median of --reps train steps after one warm-up, the two paths
interleaved. Refit: the bytes of the HF tensors the exporter gathers for the engine (the merged model, what mrl sends)
and of the adapters alone (the PEFT folder's tensors, what vLLM's own LoRA would take: benchmarks/vllm_lora.py).

    python benchmarks/lora_policy.py [--model DIR] [--rank 16 --sequences 16 --seq-len 144 --micro-batch 16 --reps 3]

--model: an HF folder with one model.safetensors, e.g. the real SmolLM2-135M-Instruct of `make real`
(.cache/real/smollm2-135m-instruct); without it a tiny Qwen2 (--hidden, --layers) built here. One rank, CPU: fp32;
with CUDA --precision bfloat16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="DIR")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=144)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    return parser.parse_args()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(optimizer, model) -> int:
    """Bytes of every tensor the optimizer keeps beside the model: Adam's states, and its main weights where they are
    not the model's own (bf16 training's fp32 copies)."""
    from mrl.policy.memory import optimizer_params, optimizer_states, storage_key

    owned = {storage_key(p) for p in model.parameters()}
    mains = [p for p in optimizer_params(optimizer) if storage_key(p) not in owned]
    return _nbytes(optimizer_states(optimizer)) + _nbytes(mains)


def bench_rank(model_dir: str, rank: int, sequences: int, seq_len: int, micro_batch: int, reps: int,
               precision: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from safetensors.torch import load_file

    from converters import model_dims
    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.model.lora import LoraSettings, apply_lora
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.export import ShardedExporter, plan_buckets
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.optim import build_optimizer, build_scheduler
    from mrl.policy.train_step import StepContext, train_on_batch
    from mrl.testing.losses import PGLoss
    from mrl.testing.tiny_models import read_config

    init_process_groups(ParallelDims())
    hf_config = read_config(model_dir)
    dtype = getattr(torch, precision)
    opt_cfg = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    state = load_file(os.path.join(model_dir, "model.safetensors"))

    def build(lora: bool):
        config = transformer_config_from_hf(hf_config, params_dtype=dtype)
        model = build_model(hf_config, config)
        load_hf_weights(model, state, hf_config)
        base = sum(p.numel() for p in model.parameters())
        if lora:
            apply_lora(model, LoraSettings(rank=rank, alpha=2.0 * rank))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = build_optimizer([ddp], opt_cfg, params_dtype=dtype)
        return model, ddp, optimizer, build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=reps + 1), base

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf_config["vocab_size"], (sequences, seq_len), generator=g)
    mask = torch.zeros(sequences, seq_len)
    mask[:, seq_len // 3:] = 1
    adv = torch.randn(sequences, generator=g)[:, None].expand(sequences, seq_len).contiguous()
    batch = RankBatch(ids, mask, token_data={"adv": adv})
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(), is_last_stage=True,
                      vocab_size=hf_config["vocab_size"])
    paths = {name: build(name == "lora") for name in ("full", "lora")}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(reps + 1):  # rep 0 warms up
        for name, (_, ddp, optimizer, scheduler, _) in paths.items():
            start = time.perf_counter()
            train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=PGLoss("token"),
                           count=global_count(mask, "token"), micro_batch_size=micro_batch, ctx=ctx)
            if rep:
                times[name].append(time.perf_counter() - start)
    out = {}
    dims = model_dims(hf_config)
    for name, (model, ddp, optimizer, _, base) in paths.items():
        grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in ddp.buffers)
        exporter = ShardedExporter(model, dims, layer_offset=0, names="local")
        merged = 0
        for bucket in plan_buckets(dims, exporter.names, 1 << 62, 4, split_units=True, stages=exporter.stages):
            merged += _nbytes(t for _, t in exporter.bucket(bucket))
        out[name] = {
            "base": base,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "weights": _nbytes(model.parameters()),
            "grads": grads,
            "optimizer": _optimizer_bytes(optimizer, model),
            "step_s": statistics.median(times[name]),
            "refit_merged": merged,
            "refit_adapters": _nbytes(t for _, t in exporter.adapter_tensors()) if name == "lora" else None,
        }
    return out


def main() -> None:
    args = _parse()
    from mrl.testing.distributed import run_on_ranks
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.abspath(args.model) if args.model else str(build_tiny_hf_model(
            os.path.join(root, "model"), "qwen2", hidden=args.hidden, layers=args.layers, heads=4, num_kv_heads=2,
            intermediate=4 * args.hidden, vocab=2048))
        (result,) = run_on_ranks(bench_rank, world_size=1, timeout_s=3600, args=(
            model_dir, args.rank, args.sequences, args.seq_len, args.micro_batch, args.reps, args.precision))
    name = os.path.basename(os.path.normpath(args.model)) if args.model else f"qwen2 h{args.hidden} x{args.layers}"
    base = result["full"]["base"]
    print(f"{name}: {base / 1e6:.1f}M parameters, {args.precision}; LoRA rank {args.rank} on every linear; "
          f"{args.sequences} sequences x {args.seq_len} tokens, micro-batch {args.micro_batch}; median of {args.reps}")
    print(f"{'':6}{'trainable':>12}{'weights':>9}{'grads':>8}{'optim':>8}{'B/param':>9}{'step s':>9}"
          f"{'refit MiB':>11}")
    states = {path: r["weights"] + r["grads"] + r["optimizer"] for path, r in result.items()}
    for path, r in result.items():
        per_param = states[path] / base
        refit = r["refit_merged"] if path == "full" else r["refit_adapters"]
        print(f"{path:6}{r['trainable']:12,}{r['weights'] / base:9.2f}{r['grads'] / base:8.2f}"
              f"{r['optimizer'] / base:8.2f}{per_param:9.2f}{r['step_s']:9.3f}{refit / 2**20:11.2f}")
    full, lora = result["full"], result["lora"]
    print(f"lora / full: trainable {lora['trainable'] / full['trainable']:.4f}, states (B/param) "
          f"{states['lora'] / states['full']:.3f}, "
          f"step time {lora['step_s'] / full['step_s']:.2f}; a refit of the merged model moves "
          f"{lora['refit_merged'] / 2**20:.2f} MiB, of the adapters alone {lora['refit_adapters'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
