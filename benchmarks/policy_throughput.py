"""Policy train and logprob throughput through mrl's train step vs a bare megatron-core loop, on the same batch.

At each tensor-parallel size (default TP1 and TP2, one rank per TP shard, gloo, fp32, OMP_NUM_THREADS=1 per rank;
on a machine with CUDA each rank takes a GPU, NCCL, and --precision bfloat16 gives bf16 weights with fp32 master
weights in both paths), both paths hold the same weights (the mrl model's state loaded into the bare one) and are timed rep by rep,
interleaved:
  mrl : `train_on_batch` (Megatron schedule, load-balanced CP split/shift, vocab-parallel logprobs with vocab
        masking, a PolicyLoss normalised by the global token count, metrics) and `logprobs_of_batch`, on
        mrl's model (`build_model`: local spec with mrl's TorchCoreAttention), DDP, `build_optimizer`.
  bare: HybridModel over Megatron's stock local layer spec (DotProductAttention), Megatron DDP, the same Megatron
        Adam; per micro-batch `model(tokens, positions, None, labels=targets)` (Megatron's own vocab-parallel
        cross entropy), the same masked advantage-weighted loss, `loss.backward()`, then
        `finalize_model_grads` and `optimizer.step()`; logprobs = -that cross entropy under no_grad.
The vocabulary (512) needs no padding at TP1/TP2, so both paths compute the same logprobs (printed as a check, over
the loss tokens); in bf16 each path's logprobs are also compared with mrl's model in fp32 (the same HF weights).
Tokens/s counts every position of the batch (N x T) per train step (one optimizer step) or logprob pass; median
over reps after one warm-up rep. Figures, not a timed test.

    python benchmarks/policy_throughput.py [--tp 1 2 --sequences 64 --seq-len 128 --micro-batch 8 --reps 5
                                            --hidden 64 --layers 2 --heads 4 --kv-heads 2 --vocab 512
                                            --precision float32]
--model DIR takes an HF folder (one model.safetensors) instead of the tiny Qwen2 built from the shape flags, e.g. the
real SmolLM2-135M-Instruct of `make real` with #38's workload (16 samples of up to 144 tokens, one micro-batch):
    python benchmarks/policy_throughput.py --model .cache/real/smollm2-135m-instruct --tp 1 --sequences 16 \
        --seq-len 144 --micro-batch 16 --reps 3
A GPU case (one H100, figures in docs/measurements.md):
    python benchmarks/policy_throughput.py --tp 1 --hidden 1024 --layers 8 --heads 16 --kv-heads 4 \
        --vocab 32768 --seq-len 1024 --precision bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--model", metavar="DIR", help="an HF model folder instead of the tiny Qwen2 (shape flags unused)")
    return parser.parse_args()


def _batch(n: int, t: int, vocab: int):
    """Token ids [n, t], a response mask [n, t] (second half, ragged ends) and per-token advantages [n, t]."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, t // 2: t - (i % (t // 4))] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return ids, mask, adv


class _PGLoss:
    level = "token"

    def __call__(self, logprobs, batch, count):
        return (-logprobs * batch["adv"] * batch["loss_mask"]).sum() / count, {}


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bare_model(mrl_model, hf_config: dict, tp: int, dtype):
    """megatron-core's HybridModel over Megatron's stock local layer spec (split into attention and MLP layers as mrl
    does, `mrl.model.hybrid`) and a config equal to the mrl model's, holding its weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from converters import model_dims
    from mrl.model import hybrid
    from mrl.model.build import transformer_config_from_hf

    config = transformer_config_from_hf(hf_config, tensor_parallel=tp, params_dtype=dtype)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    model = HybridModel(config, hybrid.stack_spec([spec]), vocab_size=mrl_model.vocab_size,
                        max_sequence_length=hf_config["max_position_embeddings"],
                        hybrid_layer_pattern=hybrid.layer_pattern(config), position_embedding_type="rope",
                        rotary_base=model_dims(hf_config).rope_theta,  # transformers 5 keeps it in rope_parameters
                        share_embeddings_and_output_weights=hf_config.get("tie_word_embeddings", False))
    model.to(_device())  # Megatron's torch norms are made on the CPU (mrl.model.build does the same)
    model.load_state_dict(mrl_model.state_dict())
    return model


def _bare_steps(ddp, optimizer, ids, mask, adv, micro_batch: int):
    """(train step, logprob pass) of the bare loop; the micro-batches share the global-count normalisation."""
    import torch
    from megatron.core.distributed import finalize_model_grads

    targets = torch.roll(ids, -1, dims=1)
    shifted_mask = torch.roll(mask, -1, dims=1)
    shifted_mask[:, -1] = 0
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    count = float(shifted_mask.sum())
    chunks = [slice(i, i + micro_batch) for i in range(0, len(ids), micro_batch)]

    def train() -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for rows in chunks:
            cross_entropy = ddp(ids[rows], positions[rows], None, labels=targets[rows])  # [b, T] = -logprob
            ((cross_entropy * adv[rows] * shifted_mask[rows]).sum() / count).backward()
        finalize_model_grads([ddp])
        optimizer.step()

    @torch.no_grad()
    def logprobs() -> torch.Tensor:
        return torch.cat([-ddp(ids[rows], positions[rows], None, labels=targets[rows]) for rows in chunks])

    return train, logprobs


def bench_rank(model_dir: str, tp: int, sequences: int, seq_len: int, micro_batch: int, reps: int,
               precision: str = "float32") -> dict | None:
    """Runs on each of `tp` ranks; rank 0 returns the tokens/s lists of both paths and the logprob check."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from safetensors.torch import load_file

    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import init_process_groups
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.policy.optim import build_optimizer, build_scheduler
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.tiny_models import read_config

    init_process_groups(ParallelDims(tp=tp, world_size=tp))
    hf_config = read_config(model_dir)
    opt_cfg = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    dtype = getattr(torch, precision)

    def wrap(model, config):
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
        config.finalize_model_grads_func = finalize_model_grads
        return ddp, build_optimizer([ddp], opt_cfg, params_dtype=dtype)

    config = transformer_config_from_hf(hf_config, tensor_parallel=tp, params_dtype=dtype)
    model = build_model(hf_config, config)
    load_hf_weights(model, load_file(os.path.join(model_dir, "model.safetensors")), hf_config)
    bare = _bare_model(model, hf_config, tp, dtype)
    mrl_ddp, mrl_opt = wrap(model, config)
    bare_ddp, bare_opt = wrap(bare, bare.config)
    scheduler = build_scheduler(mrl_opt, opt_cfg, SchedulerConfig(), total_steps=reps + 1)

    ids, mask, adv = (t.to(_device()) for t in _batch(sequences, seq_len, hf_config["vocab_size"]))
    batch = RankBatch(ids, mask, token_data={"adv": adv})
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=hf_config["vocab_size"])
    count = global_count(mask, "token")
    phases = {
        "mrl": (lambda: train_on_batch([mrl_ddp], mrl_opt, scheduler, batch, loss_fn=_PGLoss(), count=count,
                                       micro_batch_size=micro_batch, ctx=ctx),
                lambda: logprobs_of_batch([mrl_ddp], batch, micro_batch_size=micro_batch, ctx=ctx)),
        "bare": _bare_steps(bare_ddp, bare_opt, ids, mask, adv, micro_batch),
    }
    mrl_lp = phases["mrl"][1]()  # [N, T] at token positions
    bare_lp = phases["bare"][1]()  # [N, T] at predicting positions
    loss_tokens = mask[:, 1:].bool()
    check = (mrl_lp[:, 1:] - bare_lp[:, :-1])[loss_tokens].abs().max().item()
    against_fp32 = {}
    if dtype != torch.float32:  # which path bf16 moves, and how far: both against the fp32 model
        reference = build_model(hf_config, transformer_config_from_hf(hf_config, tensor_parallel=tp))
        load_hf_weights(reference, load_file(os.path.join(model_dir, "model.safetensors")), hf_config)
        ref_lp = logprobs_of_batch([reference], batch, micro_batch_size=micro_batch, ctx=ctx)[:, 1:][loss_tokens]
        for name, lp in (("mrl", mrl_lp[:, 1:]), ("bare", bare_lp[:, :-1])):
            error = (lp[loss_tokens].float() - ref_lp).abs()
            against_fp32[name] = (error.max().item(), error.mean().item())
        del reference

    def timed(fn) -> float:
        _sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync()
        dist.barrier()
        return ids.numel() / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {f"{p} {k}": [] for p in phases for k in ("train", "logprobs")}
    for rep in range(reps + 1):  # rep 0 warms up
        for path, (train, logprobs) in phases.items():
            train_rate, logprob_rate = timed(train), timed(logprobs)
            if rep:
                rates[f"{path} train"].append(train_rate)
                rates[f"{path} logprobs"].append(logprob_rate)
    return {"rates": rates, "logprob_check": check, "against_fp32": against_fp32} if dist.get_rank() == 0 else None


def main() -> None:
    args = _parse()
    from mrl.testing.distributed import run_on_ranks
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.abspath(args.model) if args.model else str(build_tiny_hf_model(
            os.path.join(root, "model"), "qwen2", hidden=args.hidden, layers=args.layers, heads=args.heads,
            num_kv_heads=args.kv_heads, intermediate=2 * args.hidden, vocab=args.vocab))
        results = {tp: run_on_ranks(bench_rank, world_size=tp, timeout_s=1800, args=(
            model_dir, tp, args.sequences, args.seq_len, args.micro_batch, args.reps, args.precision))[0]
            for tp in args.tp}
    import torch

    where = f"{torch.cuda.get_device_name()}, NCCL" if torch.cuda.is_available() else "CPU, gloo, 1 thread per rank"
    model = (f"{os.path.basename(os.path.normpath(args.model))}" if args.model else
             f"qwen2 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, "
             f"vocab {args.vocab})")
    print(f"settings: {model}, {args.precision}, {args.sequences} sequences x {args.seq_len} tokens, micro-batch "
          f"{args.micro_batch}, {where}, median of {args.reps} reps")
    print(f"{'layout':8}{'phase':10}{'mrl tok/s':>12}{'bare tok/s':>12}{'mrl/bare':>10}   max |logprob mrl - bare|")
    for tp, result in results.items():
        for phase in ("train", "logprobs"):
            mrl = statistics.median(result["rates"][f"mrl {phase}"])
            bare = statistics.median(result["rates"][f"bare {phase}"])
            print(f"{'TP' + str(tp):8}{phase:10}{mrl:12.0f}{bare:12.0f}{mrl / bare:10.3f}   "
                  f"{result['logprob_check']:.1e}")
        for name, (worst, mean) in result["against_fp32"].items():
            print(f"{'TP' + str(tp):8}{name} against the fp32 model: max |logprob difference| {worst:.2e}, "
                  f"mean {mean:.2e} (loss tokens)")


if __name__ == "__main__":
    main()
