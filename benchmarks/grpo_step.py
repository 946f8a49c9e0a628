"""Time of one GRPO step of the same workload three ways: a bare HF + torch floor, mrl synchronous, mrl async.

Two workloads (--workload), P prompts x G samples x at most T new tokens per step, fp32, 2 cores:
  tiny   : the arithmetic task of recipes/arith-tiny-cpu.yaml ("37+05=" -> "42", 0/1 exact-match reward) on its
           random-init 4-layer model (no SFT warm-up); default 8 x 8 x 32, lr 1e-3.
  smollm2: the times-table task of recipes/grpo-smollm2-135m-times-cpu.yaml (math-verify's reward) on the real
           SmolLM2-135M-Instruct (`make real`), its GRPO stage's settings (lr 2e-5); default 4 x 4 x 64 (#38's
           16 samples x 64 tokens), without dynamic sampling (every sample trains, as in the floor) and without
           the recipe's validation.
  floor: this process, torch.set_num_threads(2) (--floor-threads), HF transformers: `model.generate(do_sample,
         temperature 1, num_return_sequences=G)` on left-padded prompts; mrl's reward (`build_environment(env)`,
         a response without EOS scores 0); group-normalised advantages (`grpo_advantages`, no leave-one-out,
         std-normalised); one forward with grad over prompt + response, loss = -mean over response tokens of
         ratio * A with ratio = exp(logp - logp.detach()) (the clipped GRPO loss at ratio 1), backward, grad-norm
         clip (as mrl does), torch.optim.AdamW step with the run's optimizer settings (lr 1e-3).
         Prompts come from mrl's own task data, loader and template with the run's seed. The tiny model's folder is
         built first, by mrl's `build_initial_model` from the same config, so it holds the weights mrl starts from
         (checked byte for byte against mrl sync's own folder when both run); SmolLM2 is read from its folder.
  sync : `mrl grpo --config RECIPE` as a subprocess, with overrides giving the same P, G, T,
         one optimizer step per step (global = micro batch = P*G; the recipe packs sequences: one pack holds the
         whole batch, no padding), the workload's lr without warm-up, tiny: a small validation
         (eval.max_problems=8), no checkpoints.
         The floor trains on its padded batch, as a plain HF train step does. The engine and the policy share one
         bundle (colocated) and, as in the recipe's GRPO stage, each uses both cores (cluster.omp_num_threads=2:
         their phases never overlap).
         The engine compiles its model (generation.vllm.enforce_eager's default, which the tiny workload sets
         over its recipe's eager engine; MRL_VLLM_ENFORCE_EAGER is removed from the runs' environment): a
         start-up cost, outside the steady steps.
  async: the same plus grpo.max_off_policy_steps=1 loss.importance_sampling=tis, the engine on a bundle of its own
         (generation.colocated=false, generation.num_devices=1, cluster.devices_per_node=2): one core each
         (cluster.omp_num_threads=1).
mrl's times are read from <output_dir>/logs/metrics.jsonl. A step's time is the median `timing/step` over steps
2..N-1 for mrl (step 1 warms up, step N also validates; async's step 2 also makes the broadcast group of its first
refit, so give it --steps 6 or more) and over steps 2..N for the floor. Tokens per step: generated tokens, stop
token included (mrl: train/response_length * P*G). A mode that fails is reported as such; the others still run.
The modes take turns: --rounds R runs floor, sync, async, then again, R times (each run from scratch, same seed),
and a mode's medians pool the steady steps of its R runs. A ratio is the median over the rounds of that round's
ratio: the two modes of a round ran minutes apart, so a slow minute of the machine (other load: this is a shared
2-core VM) slows one round of the ratio, not the whole of one mode. Figures, not a timed test: other load on the
machine shows in them, most in the floor's two OpenMP threads.

    python benchmarks/grpo_step.py [--workload tiny --steps 8 --rounds 3 --prompts 8 --generations 8 --tokens 32
                                    --modes floor,sync,async --floor-threads 2 --keep DIR]
    python benchmarks/grpo_step.py --workload smollm2 --modes floor,sync --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mrl.testing.runs import MACHINERY

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the mrl subprocesses' workers, as in the Makefile
os.environ.pop("MRL_VLLM_ENFORCE_EAGER", None)  # the engine's default, whatever the shell (the test suite sets 1)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    recipe: Path
    prompts: int
    generations: int
    tokens: int
    prompt_tokens: int        # the longest prompt: the sequence length is this + tokens
    overrides: tuple[str, ...]
    built: bool               # a random-init model mrl builds (policy.build), not a folder
    label: str


WORKLOADS = {
    "tiny": Workload(ROOT / "recipes" / "arith-tiny-cpu.yaml", 8, 8, 32, 16,
                     ("policy.optimizer.lr=1e-3", "eval.max_problems=8", "generation.vllm.enforce_eager=false"), True,
                     "arith-tiny-cpu model (random init)"),
    "smollm2": Workload(ROOT / "recipes" / "grpo-smollm2-135m-times-cpu.yaml", 4, 4, 64, 80,
                        ("grpo.dynamic_sampling=false", "eval.data=null"), False, "SmolLM2-135M-Instruct"),
}
MODES = ("floor", "sync", "async")
#: The recipe's GRPO-stage threads (`mrl grpo --config` does not apply stage overrides): phases never overlap, so
#: the policy and the engine each use both cores; asynchronous, a core each.
SYNC_OVERRIDES = ["cluster.omp_num_threads=2"]
ASYNC_OVERRIDES = ["grpo.max_off_policy_steps=1", "loss.importance_sampling=tis", "generation.colocated=false",
                   "generation.num_devices=1", "cluster.devices_per_node=2", "cluster.omp_num_threads=1"]


@dataclass
class Result:
    """Medians over the steady steps (seconds), mean generated tokens per step and mean reward over all steps."""

    step: float = float("nan")
    generation: float = float("nan")
    train: float = float("nan")
    logprobs: float = float("nan")
    refit: float = float("nan")
    tokens: float = float("nan")
    reward: float = float("nan")
    error: Optional[str] = None


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode, the modes taking turns")
    parser.add_argument("--prompts", type=int, help="default: the workload's")
    parser.add_argument("--generations", type=int, help="default: the workload's")
    parser.add_argument("--tokens", type=int, help="default: the workload's")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of floor, sync, async")
    parser.add_argument("--keep", metavar="DIR", help="write the runs' outputs here and keep them")
    parser.add_argument("--floor-threads", type=int, default=2,
                        help="torch threads of the floor (fewer than the free cores: OpenMP threads stall when a "
                             "core is busy with other work)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another override of both mrl runs (repeatable), e.g. --set cluster.omp_num_threads=2")
    args = parser.parse_args()
    args.work = WORKLOADS[args.workload]
    for name in ("prompts", "generations", "tokens"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(args.work, name))
    if not args.work.built and not _model_folder().is_dir():
        parser.error(f"--workload {args.workload} needs the real model at {_model_folder()}: run `make real` "
                     "(or set MRL_REAL_ASSETS)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; pick from {', '.join(MODES)}")
    return args


def _model_folder() -> Path:
    return Path(os.environ.get("MRL_REAL_ASSETS", ROOT / ".cache" / "real")) / "smollm2-135m-instruct"


def mrl_overrides(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """The recipe's settings changed to the benchmark's workload (the floor loads its config with these too)."""
    batch = args.prompts * args.generations
    max_len = args.tokens + args.work.prompt_tokens
    return [f"grpo.max_num_steps={args.steps}", f"grpo.num_prompts_per_step={args.prompts}",
            f"grpo.num_generations_per_prompt={args.generations}", f"generation.max_new_tokens={args.tokens}",
            f"policy.max_total_sequence_length={max_len}", f"generation.vllm.max_model_len={max_len}",
            f"policy.train_global_batch_size={batch}", f"policy.train_micro_batch_size={batch}",
            f"policy.logprob_micro_batch_size={batch}",
            f"policy.sequence_packing.tokens_per_microbatch={batch * max_len}",
            *args.work.overrides, "policy.scheduler.warmup_steps=0", "grpo.val_every=0",
            *MACHINERY,  # speed, not learning: a model may score alike for 3 steps
            "checkpointing.enabled=false", f"run.output_dir={out_dir}",
            *args.set]


# ------------------------------------------------------------------------------------------------------------- mrl
class ModeFailed(RuntimeError):
    """A run of one mode that did not finish (the report shows the message)."""


def run_mrl(args: argparse.Namespace, out_dir: Path, extra: list[str]) -> list[dict]:
    """`mrl grpo` on the recipe in a subprocess; its step records (times, reward, lengths) from metrics.jsonl."""
    command = [sys.executable, "-m", "mrl.cli", "grpo", "--config", str(args.work.recipe),
               *mrl_overrides(args, out_dir), *extra]
    log = out_dir.with_suffix(".log")
    with log.open("w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-6:]
        raise ModeFailed(f"mrl grpo exited with {code}; the end of {log.name}:\n      " + "\n      ".join(tail))
    records = [r for r in _read_jsonl(out_dir / "logs" / "metrics.jsonl") if "timing/step" in r]
    if not records:
        raise ModeFailed(f"no step was logged in {out_dir / 'logs' / 'metrics.jsonl'}")
    samples = args.prompts * args.generations
    return [{**r, "tokens": r["train/response_length"] * samples, "reward": r["train/reward"]} for r in records]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steady(records: list[dict], steps: int, last_excluded: bool) -> list[dict]:
    """Steps 2..N-1 (or 2..N), or every step when that leaves none."""
    end = steps - 1 if last_excluded else steps
    return [r for r in records if 2 <= r["step"] <= end] or records


def _median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else float("nan")


def summarise(runs: list[list[dict]], steps: int, last_excluded: bool) -> Result:
    """Medians over the steady steps of every run of a mode; tokens over those steps, reward over all steps."""
    steady = [r for records in runs for r in _steady(records, steps, last_excluded)]
    return Result(step=_median(steady, "timing/step"), generation=_median(steady, "timing/generation"),
                  train=_median(steady, "timing/train"), logprobs=_median(steady, "timing/logprobs"),
                  refit=_median(steady, "timing/refit"), tokens=statistics.mean(r["tokens"] for r in steady),
                  reward=statistics.mean(r["reward"] for records in runs for r in records))


# ----------------------------------------------------------------------------------------------------------- floor
def run_floor(args: argparse.Namespace, out_dir: Path) -> list[dict]:
    """The bare loop (module docstring) on the model mrl starts from with the same config; one record per step."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mrl.app.starting_model import INITIAL_MODEL_DIR, build_initial_model
    from mrl.config import load_config
    from mrl.data.dataloader import PromptDataLoader
    from mrl.data.tasks import load_task_data
    from mrl.data.tokenizers import load_tokenizer
    from mrl.environments.registry import build_environment

    torch.set_num_threads(args.floor_threads)
    cfg = load_config(args.work.recipe, mrl_overrides(args, out_dir))
    model_dir = (build_initial_model(cfg, cfg.policy.build, out_dir / INITIAL_MODEL_DIR) if args.work.built
                 else ROOT / cfg.policy.model_name)  # relative paths: to the checkout, where mrl runs
    hf_logging.disable_progress_bar()  # one shard
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    env = None if cfg.env.kind == "math" else build_environment(cfg.env)  # math: in-process (`_rewards`)
    tokenizer, data = load_tokenizer(model_dir), load_task_data(cfg)
    loader = PromptDataLoader(data.train, args.prompts, seed=cfg.run.seed)
    opt = cfg.policy.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                  eps=opt.adam_eps, weight_decay=opt.weight_decay)
    records = []
    for step in range(1, args.steps + 1):
        record = _floor_step(model, optimizer, tokenizer, data, env, next(loader), cfg, args)
        records.append({"step": step, **record})
    return records


def _floor_step(model, optimizer, tokenizer, data, env, problems, cfg, args: argparse.Namespace) -> dict:
    """generate -> reward -> advantages -> train, timed; returns the step's times, tokens and mean reward."""
    import torch

    from mrl.data.tasks import encode_prompts
    from mrl.objectives.advantages import grpo_advantages

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    problems, prompts = encode_prompts(problems, tokenizer, data.template, cfg)
    prompt_ids, prompt_mask = _left_pad(prompts, pad)  # [P, Lp] each
    start = time.perf_counter()
    model.eval()
    out = model.generate(prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0,
                         max_new_tokens=args.tokens, num_return_sequences=args.generations, pad_token_id=pad,
                         eos_token_id=eos)  # [P*G, Lp + L]; rows of a prompt are contiguous
    responses = out[:, prompt_ids.shape[1]:]  # [P*G, L]
    is_eos = (responses == eos).long()
    response_mask = (is_eos.cumsum(dim=1) - is_eos == 0).float()  # [P*G, L]: up to and including the first EOS
    generated = time.perf_counter()
    rewards = _rewards(env, tokenizer, problems, responses, response_mask, is_eos, args.generations)  # [P*G]
    advantages = grpo_advantages(rewards.view(-1, args.generations), leave_one_out=False,
                                 normalize_std=True).view(-1)
    scored = time.perf_counter()
    _train(model, optimizer, prompt_ids.repeat_interleave(args.generations, dim=0),
           prompt_mask.repeat_interleave(args.generations, dim=0), responses, response_mask, advantages,
           cfg.policy.optimizer.clip_grad)
    end = time.perf_counter()
    return {"timing/step": end - start, "timing/generation": generated - start, "timing/reward": scored - generated,
            "timing/train": end - scored, "tokens": float(response_mask.sum()), "reward": float(rewards.mean())}


def _left_pad(prompts: list[list[int]], pad: int):
    """Token ids and attention mask [P, Lp] of prompts padded on the left (generate appends on the right)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, mask


def _rewards(env, tokenizer, problems, responses, response_mask, is_eos, group: int):
    """mrl's reward on the decoded responses; a response without EOS is unfinished (scored 0). [P*G]. The math
    reward (`env` None) is math-verify's verdict, mrl's `math_verify_reward`, called in this process, as a bare
    loop would (mrl's math environment runs it in a pool of Ray actors, with a timeout)."""
    import torch

    from mrl.environments.base import ANSWER, FINISHED
    from mrl.environments.math import math_verify_reward

    lengths = response_mask.sum(dim=1).long().tolist()
    texts = [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(responses, lengths)]
    finished = is_eos.any(dim=1).tolist()
    answers = [problems[i // group].answer for i in range(len(texts))]
    if env is None:
        return torch.tensor([math_verify_reward(t, a) if f else 0.0 for t, a, f in zip(texts, answers, finished)])
    meta = [{ANSWER: answers[i], FINISHED: finished[i]} for i in range(len(texts))]
    return env.step([[{"role": "assistant", "content": t}] for t in texts], meta).rewards.float()


def _train(model, optimizer, prompt_ids, prompt_mask, responses, response_mask, advantages, clip_grad: float):
    """One optimizer step on the on-policy clipped surrogate (ratio 1 in value, its gradient grad logp)."""
    import torch

    model.train()
    ids = torch.cat([prompt_ids, responses], dim=1)  # [B, Lp + L]
    mask = torch.cat([prompt_mask, response_mask.long()], dim=1)  # [B, Lp + L]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: the first real token is position 0
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [B, Lp + L, V]
    width = prompt_ids.shape[1]
    logits = logits[:, width - 1:-1]  # [B, L, V]: the positions predicting the response tokens
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)  # [B, L]
    ratio = torch.exp(logp - logp.detach())
    loss = -(ratio * advantages[:, None] * response_mask).sum() / response_mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()


# ---------------------------------------------------------------------------------------------------------- report
def _same_initial_model(root: Path) -> Optional[bool]:
    """Whether the floor's model folder holds the same weights as mrl sync's, in the first round (None when one is
    missing)."""
    from mrl.app.starting_model import INITIAL_MODEL_DIR

    files = [root / _run_dir(mode, 1) / INITIAL_MODEL_DIR / "model.safetensors" for mode in ("floor", "sync")]
    if not all(f.is_file() for f in files):
        return None
    return files[0].read_bytes() == files[1].read_bytes()


def _fmt(value: float, width: int, digits: int) -> str:
    text = "-" if value != value else f"{value:.{digits}f}"  # NaN: not measured in this mode
    return text.rjust(width)


def _print_report(args: argparse.Namespace, results: dict[str, Result], rounds: dict[str, list[Result]],
                  same_model: Optional[bool]) -> None:
    print(f"settings: {args.work.label}, {args.prompts} prompts x {args.generations} samples x "
          f"<= {args.tokens} new tokens, {args.steps} steps x {args.rounds} rounds (modes taking turns); floor "
          f"{args.floor_threads} threads in-process; mrl threads per worker: sync {SYNC_OVERRIDES[-1]}, async "
          f"{ASYNC_OVERRIDES[-1]}")
    if same_model is not None:
        print(f"floor and mrl sync start from identical weights: {'yes' if same_model else 'NO'}")
    print(f"{'mode':7}{'step s':>9}{'gen s':>9}{'logprob s':>11}{'train s':>9}{'refit s':>9}{'tokens/step':>13}"
          f"{'reward':>8}")
    for mode, r in results.items():
        if r.error:
            print(f"{mode:7}failed: {r.error}")
            continue
        print(f"{mode:7}{_fmt(r.step, 9, 3)}{_fmt(r.generation, 9, 3)}{_fmt(r.logprobs, 11, 3)}"
              f"{_fmt(r.train, 9, 3)}{_fmt(r.refit, 9, 3)}{_fmt(r.tokens, 13, 0)}{_fmt(r.reward, 8, 3)}")
    for top, bottom in (("sync", "floor"), ("async", "floor"), ("async", "sync")):
        a, b = results.get(top), results.get(bottom)
        if a and b and not (a.error or b.error):
            each = [x.step / y.step for x, y in zip(rounds[top], rounds[bottom])]
            print(f"step time {top} / {bottom} = {statistics.median(each):.2f}   (round by round: "
                  f"{' '.join(f'{r:.2f}' for r in each)}; of the pooled medians: {a.step / b.step:.2f})")


def _run_dir(mode: str, round_: int) -> str:
    return f"{mode}-{round_}"


def run_mode(args: argparse.Namespace, mode: str, out_dir: Path) -> list[dict]:
    """One run of `mode`: its step records."""
    if mode == "floor":
        return run_floor(args, out_dir)
    return run_mrl(args, out_dir, ASYNC_OVERRIDES if mode == "async" else SYNC_OVERRIDES)


def run_rounds(args: argparse.Namespace, root: Path) -> tuple[dict[str, Result], dict[str, list[Result]]]:
    """Every mode, `args.rounds` times, taking turns; a mode that fails once is not run again. Returns each mode's
    pooled result and its result per round."""
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in args.modes}
    failed: dict[str, str] = {}
    for round_ in range(1, args.rounds + 1):
        for mode in (m for m in args.modes if m not in failed):
            print(f"[bench] round {round_}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            try:
                runs[mode].append(run_mode(args, mode, root / _run_dir(mode, round_)))
            except Exception as error:  # noqa: BLE001 -- report the mode as failed, run the others
                failed[mode] = str(error) if isinstance(error, ModeFailed) else f"{type(error).__name__}: {error}"
    pooled = {mode: Result(error=failed[mode]) if mode in failed
              else summarise(runs[mode], args.steps, last_excluded=mode != "floor") for mode in args.modes}
    rounds = {mode: [summarise([records], args.steps, last_excluded=mode != "floor") for records in runs[mode]]
              for mode in args.modes if mode not in failed}
    return pooled, rounds


def main() -> None:
    args = _parse()
    with tempfile.TemporaryDirectory(prefix="grpo-step-") as scratch:
        root = Path(args.keep or scratch).resolve()
        os.chdir(ROOT)  # the recipes' relative paths (the real assets) are the checkout's, as for the mrl runs
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            sys.exit(f"{root} is not empty: pick an empty --keep folder")
        results, rounds = run_rounds(args, root)
        same_model = _same_initial_model(root)
    _print_report(args, results, rounds, same_model)


if __name__ == "__main__":
    main()
