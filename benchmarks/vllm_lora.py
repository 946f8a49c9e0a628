#!/usr/bin/env python
"""The two ways a LoRA policy's weights can reach vLLM, measured on one engine each (`policy.lora`, #66):

    merged   the engine holds W + (alpha / r) B A (what mrl's refit sends): a refit moves every weight of the model
             (vLLM's `reload_weights` of the whole state), generation runs the plain model
    adapter  the engine holds the base and vLLM's own LoRA (`enable_lora`, a PEFT folder added with
             `add_lora(LoRARequest(..., load_inplace=True))` each refit): a refit moves the adapters alone,
             generation runs the base plus the adapters' extra GEMMs (vLLM's punica kernels; on CPU its torch ops)

Prints, for each: the bytes one refit moves, the refit's time (median of --reps), generation tokens/s (greedy,
--prompts prompts of --tokens new tokens, median of --reps), and whether the two engines' greedy tokens agree.

    python benchmarks/vllm_lora.py --base DIR [--adapter DIR | --rank 16] [--merged DIR] [--prompts 32 --tokens 32]

--base: the HF model the adapters were trained on; --adapter: a PEFT folder (an mrl run's final_hf/lora_adapter/),
or without it random adapters of rank --rank on every linear (PEFT's, B drawn too, so they change the model);
--merged: the merged HF model (the run's final_hf/); made here from the two with PEFT when not given.
On the real SmolLM2-135M-Instruct (`make real`):
    python benchmarks/vllm_lora.py --base .cache/real/smollm2-135m-instruct --rank 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--merged")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    return parser.parse_args()


def _merge(base: str, adapter: str, out: Path) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def _random_adapter(base: str, rank: int, out: Path) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            init_lora_weights=False))
    peft.save_pretrained(out)
    return str(out)


def _engine(model: str, max_len: int, lora_rank: int | None):
    from mrl.inference.vllm_backend import VllmEngineConfig, build_llm

    config = VllmEngineConfig(model_path=model, max_model_len=max_len, kv_cache_bytes=256 << 20, lora_rank=lora_rank)
    return build_llm(config)


def _bytes(folder: str, pattern: str) -> int:
    return sum(path.stat().st_size for path in Path(folder).glob(pattern))


def _generate(llm, prompts, tokens: int, lora) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora,
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    return len(prompts) * tokens / seconds, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.lora.request import LoRARequest

    from converters.hf_io import load_hf_config

    args = _parse()
    config = load_hf_config(args.base)
    with tempfile.TemporaryDirectory() as tmp:
        args.adapter = args.adapter or _random_adapter(args.base, args.rank, Path(tmp) / "adapter")
        rank = int(json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"])
        merged = args.merged or _merge(args.base, args.adapter, Path(tmp) / "merged")
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, config["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
        max_len = args.prompt_len + args.tokens
        figures = {}

        llm = _engine(merged, max_len, None)
        state = load_file(str(Path(merged) / "model.safetensors"))
        reloads = []
        for _ in range(args.reps):
            start = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=list(state.items()),
                                                             is_checkpoint_format=True))
            reloads.append(time.perf_counter() - start)
        runs = [_generate(llm, prompts, args.tokens, None) for _ in range(args.reps)]
        figures["merged"] = (_bytes(merged, "*.safetensors"), statistics.median(reloads),
                             statistics.median(r[0] for r in runs), runs[0][1])
        del llm

        llm = _engine(args.base, max_len, rank)
        loads = []
        request = LoRARequest("policy", 1, args.adapter, load_inplace=True)  # each add replaces the loaded one
        for _ in range(args.reps):
            start = time.perf_counter()
            llm.llm_engine.add_lora(request)
            loads.append(time.perf_counter() - start)
        runs = [_generate(llm, prompts, args.tokens, request) for _ in range(args.reps)]
        figures["adapter"] = (_bytes(args.adapter, "*.safetensors"), statistics.median(loads),
                              statistics.median(r[0] for r in runs), runs[0][1])

    merged_tokens, adapter_tokens = figures["merged"][3], figures["adapter"][3]
    agree = sum(a == b for a, b in zip(merged_tokens, adapter_tokens)) / len(merged_tokens)
    print(f"model {args.base} + adapter rank {rank}; {args.prompts} prompts x {args.tokens} tokens, greedy")
    for name, (nbytes, refit, speed, _) in figures.items():
        print(f"  {name:8s} refit moves {nbytes / 2**20:9.2f} MiB in {refit:6.3f} s; generation {speed:8.1f} tok/s")
    ratio = figures["adapter"][2] / figures["merged"][2]
    print(f"  adapter / merged: bytes {figures['adapter'][0] / figures['merged'][0]:.4f}, generation speed "
          f"{ratio:.2f}; identical greedy continuations {agree:.2f}")


if __name__ == "__main__":
    main()
