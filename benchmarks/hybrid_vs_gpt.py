"""mrl's model (megatron-core's HybridModel, a transformer layer as an attention and an MLP layer) against
megatron-core's GPTModel over the same layer specs and weights: forward + backward time and the logits' difference.

Both are built in one process (world of one) from a Qwen2-shaped HF model made locally (random weights), fp32:
  hybrid: `mrl.model.build.build_model` (what every policy rank and engine runs);
  gpt   : `GPTModel` with mrl's GPT layer spec and the config counting transformer layers, the same weights (the
          converters' names), the class megatron-core 0.19 deprecates.
Each path: one warm-up step, then --reps steps of `model(ids, positions, None)` and `logits.float().mean().backward()`;
the median step time is printed with tokens/s (sequences x length / step) and the ratio hybrid / gpt.

    python benchmarks/hybrid_vs_gpt.py --hidden 256 --layers 4 --seq-len 512 --sequences 4 --reps 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path


def _models(hf_dir: Path):
    from megatron.core.models.gpt import GPTModel
    from safetensors.torch import load_file

    from converters import hf_to_megatron, model_dims
    from mrl.model.build import build_model, load_hf_weights, rope_inv_freq, transformer_config_from_hf
    from mrl.parallel.attention import gpt_layer_spec

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    dims = model_dims(cfg)
    hybrid = build_model(cfg, transformer_config_from_hf(cfg))
    load_hf_weights(hybrid, state, cfg)
    config = copy.copy(transformer_config_from_hf(cfg))
    config.num_layers = dims.num_layers  # GPTModel counts transformer layers
    gpt = GPTModel(config, gpt_layer_spec(config, use_te=False), vocab_size=hybrid.vocab_size,
                   max_sequence_length=dims.max_position_embeddings, position_embedding_type="rope",
                   rotary_base=dims.rope_theta, share_embeddings_and_output_weights=dims.tied)
    gpt.rotary_pos_emb.inv_freq = rope_inv_freq(dims)
    gpt.load_state_dict(hf_to_megatron(state, dims, 0, 1, padded_vocab=hybrid.vocab_size, names="local"), strict=False)
    return hybrid, gpt


def _step_seconds(model, ids, positions, reps: int) -> list[float]:
    times = []
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(ids, positions, None).float().mean().backward()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first is the warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    import torch

    from mrl.cpu import megatron_patches
    from mrl.parallel.groups import destroy_process_groups, init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.testing.tiny_models import build_tiny_hf_model

    megatron_patches.apply()
    init_process_groups(ParallelDims(), seed=1234)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_hf_model(Path(tmp), "qwen2", hidden=args.hidden, layers=args.layers, heads=args.heads,
                                     num_kv_heads=args.kv_heads, intermediate=4 * args.hidden,
                                     max_position_embeddings=max(args.seq_len, 64))
        hybrid, gpt = _models(hf_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 400, (args.sequences, args.seq_len), generator=g)
    positions = torch.arange(args.seq_len).expand(args.sequences, args.seq_len)
    with torch.no_grad():
        gap = float((hybrid(ids, positions, None) - gpt(ids, positions, None)).abs().max())
    tokens = args.sequences * args.seq_len
    medians = {}
    for name, model in (("gpt", gpt), ("hybrid", hybrid)):
        medians[name] = statistics.median(_step_seconds(model, ids, positions, args.reps))
        print(f"{name:>6}: {medians[name]:.3f} s per forward+backward, {tokens / medians[name]:,.0f} tokens/s")
    print(f"hybrid / gpt step time: {medians['hybrid'] / medians['gpt']:.3f}; max |logits difference|: {gap:g}")
    destroy_process_groups()


if __name__ == "__main__":
    main()
