"""The policy's train step and logprob pass at real model shapes: mrl against HF transformers + torch and bare
megatron-core, on the same RL-shaped batch and the same weights, in one run. Figures, not a timed test.

The batch (one optimizer step): sequences of uniformly random lengths in [--min-len, --max-len] (RL-shaped: a
prompt of an eighth of the sequence, the rest response, whose tokens enter the loss with one random advantage per
sequence) until --step-tokens real tokens; a policy-gradient loss normalised by the step's loss-token count.
  mrl : `build_model` (local spec, mrl's TorchCoreAttention: on CUDA a packed micro-batch goes through torch's
        variable-length flash kernel), weights in --precision with fp32 master weights (Megatron DDP with fp32
        gradient reduce, Megatron Adam), `train_on_batch` / `logprobs_of_batch` with sequence packing
        (micro-batches of --micro-tokens tokens, THD layout): what a policy worker runs.
        On CUDA without Transformer Engine SwiGLU and RoPE run as torch.compile's kernels
        (`policy.speed.compiled_fusions`, auto: the warm-up step compiles them).
  mrl_unfused: the same with those fusions off (megatron-core's unfused SwiGLU and RoPE); not run by default.
  hf  : transformers' AutoModelForCausalLM with SDPA attention, fp32 weights, bf16 autocast, torch's fused AdamW
        (the path TRL trains with); padded micro-batches of similar lengths (`rows * longest <= --micro-tokens`,
        longest first, right padding with an attention mask); logprobs by a per-row log-softmax of fp32 logits.
  bare: megatron-core's HybridModel over its stock local layer spec (DotProductAttention, which has no packed layout
        without Transformer Engine), the same weights, DDP and Adam as mrl; the same padded micro-batches as hf;
        the loss from Megatron's own cross entropy (`labels=`).
Logprob passes take micro-batches of --logprob-micro-tokens (default --micro-tokens), every path: mrl through
`policy.sequence_packing.logprob_tokens_per_microbatch`, hf and bare in padded micro-batches of that budget.
Each path runs alone on the device (the others' memory freed): one warm-up step, then --reps timed steps and
logprob passes. A path out of memory at the budgets asked runs again at half of them, down to a micro-batch of the
longest sequence, and its row names the budgets it ran at (`fitted`). Tokens/s counts the batch's real tokens.
MFU against --peak-tflops (989: dense bf16 of an H100 or H200) by two formulas: prime-rl's (6 x matmul parameters
+ 12 x layers x heads x head size x sequence length, per token) and 6N alone (matmul parameters, the output layer
included). Each path's logprobs of the loss tokens are compared with the hf path's (bf16 differs path to path by
rounding, not by a bug: the mean is the figure to read).

    python benchmarks/gpu_policy_throughput.py --shapes qwen3-0.6b qwen2.5-1.5b [--json results/gpu-policy.json]
    python benchmarks/gpu_policy_throughput.py --shapes tiny --step-tokens 2048 --micro-tokens 1024 \
        --min-len 32 --max-len 256 --precision float32      # the CPU check (tests/unit/benchmarks)
Figures: docs/measurements.md ("Policy throughput at real shapes").
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

# HF config fields of each shape (random weights: the speed does not depend on them).
SHAPES = {
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151_936,
                       tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151_936,
                         tie_word_embeddings=True, use_sliding_window=False),
    "tiny": dict(family="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}
PATHS = ("mrl", "hf", "bare")
EXTRA_PATHS = ("mrl_unfused",)


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS + EXTRA_PATHS)
    parser.add_argument("--step-tokens", type=int, default=65_536, help="real tokens of one optimizer step")
    parser.add_argument("--micro-tokens", type=int, default=16_384, help="token budget of one micro-batch")
    parser.add_argument("--logprob-micro-tokens", type=int, default=None,
                        help="token budget of a logprob pass's micro-batch, every path (default: --micro-tokens)")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--precision", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--progress", metavar="FILE",
                        help="append each path's figures to FILE (JSON lines) as soon as it is measured")
    parser.add_argument("--profile", action="store_true",
                        help="on CUDA, after the timed reps: each path's host synchronisations inside one train step "
                             "(torch.cuda.set_sync_debug_mode) and its top operators by device time (torch.profiler)")
    args = parser.parse_args(argv)
    args.logprob_micro_tokens = args.logprob_micro_tokens or args.micro_tokens
    return args


def hf_config(shape: str, max_len: int) -> dict:
    """The transformers config of `shape` as a dict (what mrl's converters read from config.json)."""
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    family = fields.pop("family")
    config = AutoConfig.for_model(family, max_position_embeddings=max(max_len, 4096), dtype="float32", **fields)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)


def _hf_config_object(config: dict):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    return AutoConfig.for_model(config["model_type"], **fields)


def make_batch(step_tokens: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    """(ids [N, T] right-padded, loss mask [N, T], advantages [N, T], lengths [N]): RL-shaped sequences."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < step_tokens:
        lengths.append(int(torch.randint(min_len, max_len + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - step_tokens  # exactly step_tokens real tokens
    if lengths[-1] < 2:
        lengths.pop()
    n, width = len(lengths), max(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(3, vocab, (length,), generator=g)
        mask[i, max(1, length // 8):length] = 1  # the response: after a prompt of an eighth of the sequence
    adv = torch.randn(n, generator=g)[:, None].expand(n, width).contiguous()
    return ids, mask, adv, torch.tensor(lengths)


def flops_per_step(config: dict, lengths: list[int]) -> dict[str, float]:
    """Training FLOPs of one step by prime-rl's formula and by 6N (N: matmul parameters, output layer included)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)  # q, o and k, v projections
    mlp = 3 * hidden * config["intermediate_size"]
    n_matmul = layers * (attention + mlp) + hidden * config["vocab_size"]
    tokens = sum(lengths)
    return {"matmul_params": n_matmul,
            "prime_rl": sum(s * (6 * n_matmul + 12 * layers * heads * head_dim * s) for s in lengths),
            "6n": 6 * n_matmul * tokens}


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _padded_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows of similar lengths, longest first, `rows * longest <= budget` (hf's and bare's micro-batches)."""
    from mrl.data.packing import dynamic_batches

    return dynamic_batches(lengths, budget).bins


class _PGLoss:
    """-advantage x logprob over the loss tokens / the step's loss-token count (mrl's loss-function contract)."""

    level = "token"

    def __call__(self, logprobs, batch, count):
        return (-logprobs * batch["adv"] * batch["loss_mask"]).sum() / count, {}


def _mrl_path(config: dict, state: dict, batch, args, compiled_fusions: bool | None = None):
    """(train, logprobs) of mrl's own step: the policy worker's model, DDP, optimizer and train step;
    `compiled_fusions` as `transformer_config_from_hf` takes it (None: with CUDA)."""
    import torch
    from megatron.core import parallel_state as ps

    from mrl.config.schema import OptimizerConfig, PackingConfig, SchedulerConfig
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.optim import build_scheduler
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

    dtype = getattr(torch, args.precision)
    tconfig = transformer_config_from_hf(config, params_dtype=dtype, compiled_fusions=compiled_fusions)
    model = build_model(config, tconfig)
    load_hf_weights(model, state, config)
    ddp, optimizer = _megatron_wrap(model, tconfig, dtype)
    scheduler = build_scheduler(optimizer, OptimizerConfig(lr=1e-6), SchedulerConfig(), total_steps=args.reps + 2)
    ids, mask, adv, lengths = batch
    device = _device()
    rank_batch = RankBatch(ids.to(device), mask.to(device), token_data={"adv": adv.to(device)},
                           lengths=lengths.to(device))
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=config["vocab_size"])
    packing = PackingConfig(enabled=True, tokens_per_microbatch=args.micro_tokens,
                            logprob_tokens_per_microbatch=args.logprob_micro_tokens)
    count = global_count(mask, "token")

    def train() -> None:
        train_on_batch([ddp], optimizer, scheduler, rank_batch, loss_fn=_PGLoss(), count=count, micro_batch_size=1,
                       ctx=ctx, packing=packing)

    def logprobs():
        return logprobs_of_batch([ddp], rank_batch, micro_batch_size=1, ctx=ctx, packing=packing)  # token positions

    return train, logprobs


def _megatron_wrap(model, tconfig, dtype):
    """Megatron DDP (fp32 gradient reduce) and Megatron Adam with fp32 master weights: a policy worker's setup."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from mrl.config.schema import OptimizerConfig
    from mrl.policy.optim import build_optimizer

    ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    tconfig.finalize_model_grads_func = finalize_model_grads
    return ddp, build_optimizer([ddp], OptimizerConfig(lr=1e-6, weight_decay=0.0), params_dtype=dtype)


def _bare_path(config: dict, state: dict, batch, args):
    """(train, logprobs) of bare megatron-core: its HybridModel over the stock local layer spec (split into attention
    and MLP layers as mrl does, `mrl.model.hybrid`), padded micro-batches, Megatron's cross entropy."""
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from converters import hf_to_megatron, model_dims
    from mrl.model import hybrid
    from mrl.model.build import transformer_config_from_hf

    dtype = getattr(torch, args.precision)
    tconfig = transformer_config_from_hf(config, params_dtype=dtype)
    dims = model_dims(config)
    spec = get_gpt_layer_local_spec(qk_layernorm=tconfig.qk_layernorm, normalization=tconfig.normalization)
    model = HybridModel(tconfig, hybrid.stack_spec([spec]), vocab_size=config["vocab_size"], max_sequence_length=config[
        "max_position_embeddings"], hybrid_layer_pattern=hybrid.layer_pattern(tconfig), position_embedding_type="rope",
        rotary_base=dims.rope_theta, share_embeddings_and_output_weights=dims.tied)
    model.to(_device())  # Megatron's torch norms are made on the CPU
    weights = {hybrid.to_hybrid(k): v for k, v in hf_to_megatron(
        state, dims, 0, 1, padded_vocab=config["vocab_size"], names="local").items()}
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if own - set(weights):
        raise ValueError(f"the converted weights miss {sorted(own - set(weights))[:4]}")
    model.load_state_dict({k: weights[k] for k in own}, strict=False)
    ddp, optimizer = _megatron_wrap(model, tconfig, dtype)
    micro, lp_micro = _padded(batch, args.micro_tokens), _padded(batch, args.logprob_micro_tokens)

    def train() -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for ids, positions, targets, loss_mask, adv in micro:
            cross_entropy = ddp(ids, positions, None, labels=targets)  # [b, T] = -logprob of the next token
            ((cross_entropy * adv * loss_mask).sum() / micro.count).backward()
        finalize_model_grads([ddp])
        optimizer.step()

    @torch.no_grad()
    def logprobs():
        return [-ddp(ids, positions, None, labels=targets) for ids, positions, targets, _, _ in lp_micro]

    return train, logprobs


class _Padded(list):
    count: float  # the step's loss tokens
    bins: list[list[int]]  # each micro-batch's batch rows


def _padded(batch, budget: int) -> _Padded:
    """hf's and bare's micro-batches on the device: (ids, positions, next-token targets, loss mask and advantages
    at predicting positions) [b, longest] each; `.count` = the step's loss tokens."""
    import torch

    ids, mask, adv, lengths = batch
    device = _device()
    out = _Padded()
    out.count = float(mask[:, 1:].sum())
    out.bins = _padded_micro_batches(lengths.tolist(), budget)
    for rows in out.bins:
        width = int(lengths[rows].max())
        mb_ids = ids[rows, :width]
        targets = torch.roll(mb_ids, -1, dims=1)
        loss_mask = torch.roll(mask[rows, :width], -1, dims=1)
        loss_mask[:, -1] = 0
        positions = torch.arange(width).expand(len(rows), width)
        out.append(tuple(t.to(device) for t in (mb_ids, positions, targets, loss_mask, adv[rows, :width])))
    return out


def _hf_path(config: dict, state: dict, batch, args):
    """(train, logprobs) of HF transformers + torch: SDPA, fp32 weights, bf16 autocast, fused AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config_object(config), attn_implementation="sdpa",
                                             dtype=torch.float32)
    model.load_state_dict(state, strict=False)  # tied: lm_head.weight is the embedding
    model.to(_device()).train()
    fused = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=fused)
    micro, lp_micro = _padded(batch, args.micro_tokens), _padded(batch, args.logprob_micro_tokens)
    autocast = torch.autocast(_device().type, dtype=torch.bfloat16, enabled=args.precision == "bfloat16")
    _, _, _, lengths = batch

    def forward(ids, rows) -> torch.Tensor:
        """[b, T] logprobs of the next tokens; each row's log-softmax in fp32 on its own (TRL's
        selective_log_softmax), padding masked out of attention."""
        width = ids.shape[1]
        attention = (torch.arange(width, device=ids.device)[None] < lengths[rows].to(ids.device)[:, None]).long()
        with autocast:
            logits = model(input_ids=ids, attention_mask=attention).logits  # [b, T, V]
        targets = torch.roll(ids, -1, dims=1)
        return torch.stack([row.float().log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)
                            for row, t in zip(logits, targets)])

    def train() -> None:
        optimizer.zero_grad(set_to_none=True)
        for (ids, _, _, loss_mask, adv), rows in zip(micro, micro.bins):
            ((-forward(ids, rows) * adv * loss_mask).sum() / micro.count).backward()
        optimizer.step()

    @torch.no_grad()
    def logprobs():
        model.eval()
        out = [forward(ids, rows) for (ids, *_), rows in zip(lp_micro, lp_micro.bins)]
        model.train()
        return out

    return train, logprobs


def _loss_token_logprobs(path: str, result, batch, budget: int):
    """The loss tokens' logprobs, row by row in the batch's order, whichever layout the path returned them in."""
    import torch

    _, mask, _, lengths = batch
    if path.startswith("mrl"):  # [N, T] at token positions: position t holds the logprob of token t
        rows = {row: result[row, 1:] for row in range(len(lengths))}
    else:  # padded micro-batches [b, longest] at predicting positions: position t holds that of token t+1
        rows = {row: values[i] for bin_rows, values in zip(_padded_micro_batches(lengths.tolist(), budget), result)
                for i, row in enumerate(bin_rows)}
    pieces = []
    for row, length in enumerate(lengths.tolist()):  # tokens 1 .. length-1, those of the loss
        keep = mask[row, 1:length].bool()
        pieces.append(rows[row][:length - 1].float().cpu()[keep])
    return torch.cat(pieces)


def time_path(path: str, config: dict, state: dict, batch, args) -> dict:
    """One path alone on the device: its tokens/s in train and logprobs, peak memory, loss-token logprobs."""
    import torch

    unfused = functools.partial(_mrl_path, compiled_fusions=False)
    build = {"mrl": _mrl_path, "mrl_unfused": unfused, "hf": _hf_path, "bare": _bare_path}[path]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train, logprobs = build(config, state, batch, args)
    tokens = int(batch[3].sum())
    first = _loss_token_logprobs(path, logprobs(), batch, args.logprob_micro_tokens)  # before any update
    train()  # warm-up
    _sync()
    train_s, logprob_s = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        train()
        _sync()
        train_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        logprobs()
        _sync()
        logprob_s.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    profile = _profile(train) if args.profile and torch.cuda.is_available() else None
    return {"profile": profile,"train_s": statistics.median(train_s), "logprob_s": statistics.median(logprob_s),
            "train_tok_s": tokens / statistics.median(train_s), "logprob_tok_s": tokens / statistics.median(logprob_s),
            "peak_gib": peak, "logprobs": first}


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fitted(path: str, config: dict, state: dict, batch, args, measure=None) -> dict:
    """`time_path` at the largest micro-batch budgets that fit: after an out-of-memory error both budgets (train and
    logprob) are halved and the path built again, while a micro-batch still holds the longest sequence (bare
    megatron-core's local attention keeps [rows, heads, T, T] scores: a 16K-token padded micro-batch does not fit
    where mrl's packed one does). The result names the budgets it ran at, and those that did not fit."""
    import torch

    measure = measure or time_path
    budgets, too_large = argparse.Namespace(**vars(args)), []
    while True:
        try:
            result = measure(path, config, state, batch, budgets)
            break
        except torch.OutOfMemoryError as err:
            too_large.append(budgets.micro_tokens)
            reason = str(err).splitlines()[0]
        _free_device_memory()  # the failed build's tensors, released with the exception
        if budgets.micro_tokens // 2 < args.max_len:
            return {"error": f"out of memory at micro-batches of {', '.join(map(str, too_large))} tokens "
                             f"(the last: {reason})", "too_large": too_large}
        budgets.micro_tokens //= 2
        budgets.logprob_micro_tokens = max(budgets.logprob_micro_tokens // 2, args.max_len)
    return {**result, "micro_tokens": budgets.micro_tokens, "logprob_micro_tokens": budgets.logprob_micro_tokens,
            "too_large": too_large}


def host_syncs(work) -> collections.Counter[str]:
    """Every call inside `work()` that made the host wait for the device (the warnings of torch's sync debug mode:
    reads to the host, copies from pageable host memory, explicit synchronisations), counted by the source line
    that made it. CUDA only."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message))


def _profile(train) -> dict:
    """Where one train step waits on the host and spends the device's time: every synchronising call
    (`host_syncs`) and the top operators by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sites = host_syncs(train)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train()
        torch.cuda.synchronize()
    top = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    return {"host_syncs": sum(sites.values()), "sync_sites": dict(sites.most_common(15)), "top_ops": top}


def bench_shape(shape: str, args) -> dict:
    """Every path of one shape on this process's device (rank 0 of a one-rank group)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims())
    config = hf_config(shape, args.max_len)
    torch.manual_seed(0)
    with torch.device(_device()):
        # HF's own initialisation
        source = AutoModelForCausalLM.from_config(_hf_config_object(config), dtype=torch.float32)
    state = {k: v.detach().cpu() for k, v in source.state_dict().items()}
    del source
    batch = make_batch(args.step_tokens, args.min_len, args.max_len, config["vocab_size"])
    flops = flops_per_step(config, batch[3].tolist())
    results = {}
    for path in args.paths:
        results[path] = fitted(path, config, state, batch, args)
        if args.progress:
            with open(args.progress, "a") as f:
                f.write(json.dumps({"shape": shape, "path": path, **{k: v for k, v in results[path].items()
                                                                       if k != "logprobs"}}, default=str) + "\n")
        _free_device_memory()
    reference = results.get("hf", {}).get("logprobs")
    for result in results.values():
        lp = result.pop("logprobs", None)
        if lp is not None and reference is not None and lp.shape == reference.shape:
            diff = (lp - reference).abs()
            result["logprob_vs_hf"] = {"max": diff.max().item(), "mean": diff.mean().item()}
        if "train_s" in result:
            result["mfu_prime_rl"] = flops["prime_rl"] / result["train_s"] / (args.peak_tflops * 1e12)
            result["mfu_6n"] = flops["6n"] / result["train_s"] / (args.peak_tflops * 1e12)
            result["logprob_over_train"] = result["logprob_s"] / result["train_s"]
    return {"shape": shape, "sequences": len(batch[3]), "tokens": int(batch[3].sum()),
            "matmul_params": flops["matmul_params"], "paths": results}


def table(results: list[dict], args) -> str:
    lines = [f"{'shape':14}{'path':12}{'train tok/s':>13}{'MFU':>7}{'MFU 6N':>8}{'logprob tok/s':>15}"
             f"{'lp/train':>9}{'peak GiB':>10}{'vs hf':>8}   |logprob - hf's| mean (max)"]
    for shape in results:
        hf = shape["paths"].get("hf", {}).get("train_tok_s")
        for path, r in shape["paths"].items():
            if "error" in r:
                lines.append(f"{shape['shape']:14}{path:12}  {r['error']}")
                continue
            ratio = f"{r['train_tok_s'] / hf:8.2f}" if hf else f"{'-':>8}"
            check = r.get("logprob_vs_hf")
            peak = f"{r['peak_gib']:10.1f}" if r["peak_gib"] is not None else f"{'-':>10}"
            lines.append(f"{shape['shape']:14}{path:12}{r['train_tok_s']:13.0f}{100 * r['mfu_prime_rl']:6.1f}%"
                         f"{100 * r['mfu_6n']:7.1f}%{r['logprob_tok_s']:15.0f}{r['logprob_over_train']:9.2f}{peak}"
                         f"{ratio}   " + (f"{check['mean']:.2e} ({check['max']:.1e})" if check else "-")
                         + _budget_note(r, args))
    return "\n".join(lines)


def _budget_note(result: dict, args) -> str:
    """Where a path ran at smaller micro-batches than asked (`fitted`): the budgets it ran at."""
    if not result.get("too_large"):
        return ""
    return (f"   [micro-batches of {result['micro_tokens']} tokens ({result['logprob_micro_tokens']} in logprob "
            f"passes): {', '.join(map(str, result['too_large']))} did not fit]")


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    from mrl.testing.distributed import run_on_ranks

    results = [run_on_ranks(bench_shape, world_size=1, timeout_s=3600, args=(shape, args))[0] for shape in args.shapes]
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 1 thread"
    print(f"settings: {args.precision}, one step = {results[0]['tokens']} real tokens in sequences of "
          f"{args.min_len}-{args.max_len}, micro-batches of {args.micro_tokens} tokens ({args.logprob_micro_tokens} "
          f"in logprob passes), {where}, median of "
          f"{args.reps} reps, MFU against {args.peak_tflops:.0f} TFLOP/s")
    print(table(results, args))
    for shape in results:
        for path, r in shape["paths"].items():
            if r.get("profile"):
                p = r["profile"]
                print(f"\n{shape['shape']} {path}: {p['host_syncs']} host synchronisations in one train step; "
                      f"by site: {p['sync_sites']}\n{p['top_ops']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "device": where, "torch": torch.__version__, "results": results}, f,
                      indent=1)
    return results


if __name__ == "__main__":
    main()
