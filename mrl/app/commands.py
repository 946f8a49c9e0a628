"""The `mrl grpo | sft | dpo | rm | eval | score` commands: start the workers, run a loop, export the result, shut down.

Every training command ends by exporting the final policy, marked complete by a `.complete` file written last, in
`run.final_format`: an HF folder `<run.output_dir>/final_hf` (what vLLM or transformers load), or a Megatron
checkpoint folder `<run.output_dir>/final_megatron` (model/ written by every rank in its layout, hf/ with config and
tokenizer; no gather to one process, no HF export). Either is what the next stage of a staged recipe starts from.
`mrl eval` writes `summary.json` and every sample to `samples.jsonl`, and prints a few. A run that a guard stops
(too many non-finite or idle steps in a row) writes its summary.json all the same, saying why. Every command ends by
printing where its results are (`run_command`; the folder's layout: mrl/app/results.py).

A worker that dies (or raises) ends the command with `RunFailed`: one message naming the group, rank and method,
where the newest checkpoint is, and that re-running the same command resumes from it; unless the failure comes from
the configuration (mrl/app/errors.py `configuration_failure`), which a re-run would meet again: a `ConfigError` then.
What a command reads (data, tokenizer, the engine's model) is checked before any worker starts (mrl/app/preflight.py).
"""

from __future__ import annotations

import functools
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from mrl.algorithms.health import check_prompt_budget, check_sft_rows, health_summary
from mrl.app.checkpointing import CRITIC_SUBDIR, RunCheckpoints, resume_padded_vocab
from mrl.app.errors import RunFailed, StorageFailed, configuration_failure
from mrl.app.hub_ids import resolve_hub_ids
from mrl.app.model_source import ModelSource, classify_model_path
from mrl.app.preflight import (
    check_fills_a_batch,
    check_output_file,
    check_output_folders,
    check_score_rows,
    check_tokenizers,
    model_vocab_size,
)
from mrl.app.results import (
    DONE_MARKER,
    LORA_ADAPTER_DIR,
    final_dir,
    last_metrics,
    run_report,
    save_summary,
    summary_on_stop,
)
from mrl.app.runtime import Runtime, start_runtime
from mrl.app.starting_model import load_tokenizer, resolve_model
from mrl.app.storage import storage_guard
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.logging.metrics import MetricsLogger


def _say(message: str) -> None:
    print(f"[mrl] {message}", file=sys.stderr, flush=True)


def _logger(cfg: MrlConfig, total_steps: int, description: str, key_metrics) -> MetricsLogger:
    return MetricsLogger.from_config(
        cfg.logger,
        total_steps=total_steps,
        description=description,
        key_metrics=key_metrics,
        run_config=cfg.model_dump(mode="json"),
    )


def _resume_hint(cfg: MrlConfig) -> str:
    """Where a re-run of this command starts from."""
    from mrl.checkpoint.manager import CheckpointManager

    command = "mrl " + shlex.join(sys.argv[1:])
    if not (cfg.checkpointing.enabled and cfg.checkpointing.resume):
        return f"checkpointing is off for this run: `{command}` starts it again from the beginning"
    latest = CheckpointManager(cfg.checkpointing.dir, keep_last=cfg.checkpointing.keep_last).latest()
    if latest is None:
        return f"no checkpoint was written yet: `{command}` starts it again from the beginning"
    return f"the newest checkpoint is {latest}; `{command}` resumes from it"


@contextmanager
def explained_failures(cfg: MrlConfig) -> Iterator[None]:
    """Turn a worker failure into `RunFailed` (see the module docstring)."""
    from mrl.algorithms.guards import NonFiniteTraining
    from mrl.distributed import WorkerDiedError, WorkerError

    try:
        yield
    except StorageFailed as error:
        raise RunFailed(f"{error}.\n  {_resume_hint(cfg)}") from error
    except NonFiniteTraining as error:
        raise NonFiniteTraining(f"{error}\n  {_resume_hint(cfg)}, once the settings are changed") from error
    except WorkerError as error:
        refused = configuration_failure(error)  # a re-run would meet it again: the fix, no advice to re-run
        if refused is not None:
            raise refused from error
        message = str(error).split("\n--- remote traceback ---")[0]
        detail = (
            ""
            if isinstance(error, WorkerDiedError) or not error.remote_traceback
            else f"\n--- remote traceback ---\n{error.remote_traceback}"
        )
        raise RunFailed(f"{message}\n  {_resume_hint(cfg)}{detail}") from error


def _started(cfg: MrlConfig, **options: Any) -> Runtime:
    """`start_runtime(cfg, **options)`; a worker that dies or fails while the run starts ends it as in the loop
    (`explained_failures`: one message, where a re-run resumes, exit 4), never with a traceback."""
    with explained_failures(cfg):
        return start_runtime(cfg, **options)


def export_final(runtime: Runtime, *, language_model: bool = True) -> Path:
    """The policy's current weights in `run.final_format` (see the module docstring). Written under a temporary
    name, marked complete, then renamed into place: an interrupted export never looks finished, and a run started
    from its own earlier export still reads that one's config while writing. With `policy.lora` the HF folder holds
    the merged model and, for a language model (`language_model`; not a reward model's score head), the adapters
    alone as a PEFT folder `lora_adapter/` over the base the run started from."""
    import os
    import shutil

    out = final_dir(runtime.cfg)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with storage_guard(f"the final export {out.name}", out.parent, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        _write_export(runtime, tmp)
        if runtime.cfg.policy.lora is not None and language_model:
            _write_adapter(runtime, tmp / LORA_ADAPTER_DIR)
        (tmp / DONE_MARKER).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def _write_export(runtime: Runtime, out: Path) -> None:
    from converters.hf_io import copy_model_metadata, save_hf_state
    from mrl.checkpoint.megatron import HF_SUBDIR

    policy = runtime.policy
    assert policy is not None, "an export needs the policy"
    if runtime.cfg.run.final_format == "megatron":
        policy.save(str(out), weights_only=True)  # every rank writes its own shards
        copy_model_metadata(runtime.model_dir, out / HF_SUBDIR)
    else:
        save_hf_state(policy.export_state().items(), out, log=lambda message: None)
        copy_model_metadata(runtime.model_dir, out)


def _write_adapter(runtime: Runtime, out: Path) -> None:
    from converters import model_dims
    from converters.hf_io import load_hf_config, save_peft_adapter

    lora, policy = runtime.cfg.policy.lora, runtime.policy
    assert lora is not None and policy is not None, "an adapter export needs the policy's adapters"
    if "experts" in lora.targets and model_dims(load_hf_config(runtime.model_dir)).moe is not None:
        _say(f"no {out.name}/: routed experts' adapters have no PEFT folder; the merged model carries them")
        return
    save_peft_adapter(
        policy.export_adapters(),
        out,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        base_model=runtime.cfg.policy.model_name or str(runtime.model_dir),
    )


def _curve(history: dict, name: str) -> list[float]:
    return [value for _, value in history.get(name, [])]


def _grpo_summary(history: dict, final: dict[str, float], seconds: float) -> dict[str, Any]:
    rewards = _curve(history, "train/reward")
    accuracy = _curve(history, "val/accuracy")
    return {
        "algorithm": "grpo",
        "seconds": seconds,
        "reward_curve": rewards,
        "reward_first10": sum(rewards[:10]) / max(1, len(rewards[:10])),
        "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
        "val_accuracy_before": accuracy[0] if accuracy else None,
        "val_accuracy_after": final.get("val/accuracy"),
        "token_mult_prob_error_max": max(_curve(history, "train/token_mult_prob_error"), default=None),
        "health": health_summary(history),
        "final": final,
        **({"env": _env_summary(history, final)} if any(k.startswith("train/env/") for k in history) else {}),
    }


def _env_summary(history: dict, final: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each environment's figures of a run with several (`envs`): its reward over the first and last 10 steps it had
    samples in, and its held-out accuracy at the first and the last validation."""
    names = sorted({k.split("/")[2] for k in history if k.startswith(("train/env/", "val/env/")) and k.count("/") == 3})
    out = {}
    for name in names:
        rewards = _curve(history, f"train/env/{name}/reward")
        accuracy = _curve(history, f"val/env/{name}/accuracy")
        out[name] = {
            "reward_first10": sum(rewards[:10]) / len(rewards[:10]) if rewards else None,
            "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
            "val_accuracy_before": accuracy[0] if accuracy else None,
            "val_accuracy_after": final.get(f"val/env/{name}/accuracy"),
        }
    return out


def _grpo_environment(cfg: MrlConfig, runtime: Runtime, template: Any) -> Any:
    """The verifier (env.kind), wrapped with the reward model's score when env.reward_model is set."""
    from mrl.environments.registry import build_run_environment
    from mrl.environments.reward_model import RewardModelEnvironment

    env = build_run_environment(cfg)
    rm = cfg.env.reward_model
    if rm is None:
        return env
    tokenizer = runtime.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ends = {template.turn_end_id(tokenizer), tokenizer.eos_token_id} - {None}
    assert runtime.reward_model is not None  # start_runtime starts one for env.reward_model
    return RewardModelEnvironment(
        env, runtime.reward_model, pad_id=pad, weight=rm.weight, verifier_weight=rm.verifier_weight, end_token_ids=ends
    )


def _critic_source(cfg: MrlConfig, source: ModelSource, tokenizer: Any) -> Optional[ModelSource]:
    """PPO's value model to start from: ppo.critic.model_name (a reward model, or a language model given a score
    head), else the policy's model with a fresh score head; None without PPO."""
    from mrl.app.reward_model import reward_model_source

    if cfg.grpo.advantage_estimator != "gae":
        return None
    start = source
    if cfg.ppo.critic.model_name:
        start = classify_model_path(cfg.ppo.critic.model_name, key="ppo.critic.model_name")
    return reward_model_source(
        start, Path(cfg.run.output_dir), pad_token_id=tokenizer.pad_token_id, seed=cfg.run.seed, name="critic_init"
    )


def _check_val_prompts(cfg: MrlConfig, tokenizer: Any, data: Any) -> None:
    """The validation (or evaluation) prompts: each source's template renders with room for a problem, and not every
    one of its first prompts is too long to be generated from (`check_prompt_budget`)."""
    for index, (template, problems) in enumerate(data.by_template(val=True)):
        check_prompt_budget(cfg, tokenizer, template, problems, rows="validation", source=_val_key(cfg, index))


def _val_key(cfg: MrlConfig, index: int) -> str:
    """The key of the file the validation prompts of source `index` come from."""
    if cfg.eval.data:
        return "eval.data"
    if cfg.data.sources:
        return f"data.sources[{index}].val"
    return "data.arith" if cfg.data.arith is not None else "data.val"


def run_grpo(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.grpo import KEY_METRICS, grpo_train
    from mrl.algorithms.ppo import needs_reference
    from mrl.config.checks import rollout_problems
    from mrl.data.tasks import load_task_data

    start = time.perf_counter()
    batch_rules = rollout_problems(cfg)  # a plain config's (a staged one's were checked with the tree)
    if batch_rules:
        raise ConfigError("", problems=batch_rules)
    data = load_task_data(cfg, val_source=cfg.eval.data)
    source = resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, source)
    for template, problems in data.by_template():
        check_prompt_budget(cfg, tokenizer, template, problems)
    _check_val_prompts(cfg, tokenizer, data)
    check_fills_a_batch(
        len(data.train), cfg.grpo.num_prompts_per_step, batch_key="grpo.num_prompts_per_step", what="prompts"
    )
    check_tokenizers(cfg, tokenizer)
    runtime = _started(
        cfg,
        total_steps=cfg.grpo.max_num_steps,
        reference=cfg.loss.kl_beta > 0 or needs_reference(cfg),
        padded_vocab=resume_padded_vocab(cfg),
        source=source,
        tokenizer=tokenizer,
        critic=_critic_source(cfg, source, tokenizer),
        critic_padded_vocab=resume_padded_vocab(cfg, CRITIC_SUBDIR),
    )
    try:
        env = _grpo_environment(cfg, runtime, data.template)
    except BaseException:
        runtime.shutdown()
        raise
    try:
        with (
            explained_failures(cfg),
            RunCheckpoints(cfg, runtime) as ckpt,
            _logger(cfg, cfg.grpo.max_num_steps, f"{cfg.run.name} grpo", KEY_METRICS) as logger,
            summary_on_stop(
                Path(cfg.run.output_dir),
                lambda: _grpo_summary(logger.history, last_metrics(logger.history), time.perf_counter() - start),
            ),
        ):
            final = grpo_train(
                cfg,
                runtime,  # type: ignore[arg-type]  # Workers: its policy and engine, Optional in Runtime, are started
                env,
                data,
                logger,
                ckpt,
                val_env=getattr(env, "verifier", env),
            )
            ckpt.end_if_interrupted()
            history = logger.history
            export_final(runtime)
    finally:
        env.shutdown()
        runtime.shutdown()
    summary = _grpo_summary(history, final, time.perf_counter() - start)
    save_summary(Path(cfg.run.output_dir), summary)  # and the reward curve beside it
    return summary


def run_sft(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.sft import KEY_METRICS, sft_train
    from mrl.data.tasks import load_task_data

    start = time.perf_counter()
    data = load_task_data(cfg)
    source = resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, source)
    check_sft_rows(cfg, tokenizer, data.template, data.train)
    if data.arith is None:  # the synthetic task makes its examples
        check_fills_a_batch(
            len(data.train),
            cfg.policy.train_global_batch_size,
            batch_key="policy.train_global_batch_size",
            what="examples",
        )
    runtime = _started(
        cfg,
        total_steps=cfg.sft.max_num_steps,
        engine=False,
        padded_vocab=resume_padded_vocab(cfg),
        source=source,
        tokenizer=tokenizer,
    )
    try:
        with (
            explained_failures(cfg),
            RunCheckpoints(cfg, runtime) as ckpt,
            _logger(cfg, cfg.sft.max_num_steps, f"{cfg.run.name} sft", KEY_METRICS) as logger,
            summary_on_stop(
                Path(cfg.run.output_dir),
                lambda: _sft_summary(last_metrics(logger.history), time.perf_counter() - start),
            ),
        ):
            final = sft_train(cfg, runtime, data, logger, ckpt)  # type: ignore[arg-type]  # Runtime.policy is Optional
            ckpt.end_if_interrupted()
            export_final(runtime)
    finally:
        runtime.shutdown()
    summary = _sft_summary(final, time.perf_counter() - start)
    save_summary(Path(cfg.run.output_dir), summary)
    return summary


def _sft_summary(final: dict[str, float], seconds: float) -> dict[str, Any]:
    return {"algorithm": "sft", "seconds": seconds, "final": final}


def _check_pairs(cfg: MrlConfig) -> None:
    """The rule of pair training (even micro-batches), as config errors."""
    from mrl.config.checks import pair_problems

    problems = pair_problems(cfg, max(cfg.data_parallel_size, 1))
    if problems:
        raise ConfigError("", problems=problems)


def _pair_summary(
    algorithm: str, history: dict, final: dict[str, float], seconds: float, accuracy: str
) -> dict[str, Any]:
    curve = _curve(history, accuracy)
    before, after = curve[0] if curve else None, final.get(accuracy)
    return {
        "algorithm": algorithm,
        "seconds": seconds,
        f"{accuracy}_curve": curve,
        f"{accuracy}_before": before,
        f"{accuracy}_after": after,
        "val_accuracy_before": before,
        "val_accuracy_after": after,
        "final": final,
    }


def _run_pairs(
    cfg: MrlConfig,
    algorithm: str,
    steps: int,
    train: Any,
    key_metrics: Any,
    accuracy: str,
    *,
    reference: bool = False,
    source: ModelSource | None = None,
    tokenizer: Any = None,
    data: Any = None,
) -> dict[str, Any]:
    """Start the policy (no engine), train on preference pairs with `train`, export, summarise. `tokenizer` and
    `data`: `source`'s and the pairs, when the command already loaded them."""
    from mrl.algorithms.pairs import load_pair_data

    _check_pairs(cfg)
    start = time.perf_counter()
    source = source or resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, source) if tokenizer is None else tokenizer
    data = load_pair_data(cfg, tokenizer) if data is None else data  # before any worker starts: errors are the data's
    check_fills_a_batch(
        2 * len(data.train),
        cfg.policy.train_global_batch_size,
        batch_key="policy.train_global_batch_size",
        what="sequences (two a pair)",
    )
    runtime = _started(
        cfg,
        total_steps=steps,
        engine=False,
        reference=reference,
        source=source,
        padded_vocab=resume_padded_vocab(cfg),
        tokenizer=tokenizer,
    )
    try:
        with (
            explained_failures(cfg),
            RunCheckpoints(cfg, runtime) as ckpt,
            _logger(cfg, steps, f"{cfg.run.name} {algorithm}", key_metrics) as logger,
            summary_on_stop(
                Path(cfg.run.output_dir),
                lambda: _pair_summary(
                    algorithm, logger.history, last_metrics(logger.history), time.perf_counter() - start, accuracy
                ),
            ),
        ):
            final = train(cfg, runtime, data, logger, ckpt)
            ckpt.end_if_interrupted()
            history = logger.history
            export_final(runtime, language_model=algorithm != "rm")
    finally:
        runtime.shutdown()
    summary = _pair_summary(algorithm, history, final, time.perf_counter() - start, accuracy)
    save_summary(Path(cfg.run.output_dir), summary)
    return summary


def run_dpo(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.dpo import KEY_METRICS, dpo_train

    return _run_pairs(
        cfg, "dpo", cfg.dpo.max_num_steps, dpo_train, KEY_METRICS, "val/preference_accuracy", reference=True
    )


def run_rm(cfg: MrlConfig) -> dict[str, Any]:
    """`mrl rm`: a language model is first turned into a reward model (mrl/app/reward_model.py)."""
    from mrl.algorithms.pairs import load_pair_data
    from mrl.algorithms.rm import KEY_METRICS, rm_train
    from mrl.app.reward_model import reward_model_source

    _check_pairs(cfg)  # the rules, the tokenizer and the data before the reward model's folder is written
    lm = resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, lm)  # the reward model's folder gets a copy of it
    data = load_pair_data(cfg, tokenizer)
    source = reward_model_source(lm, Path(cfg.run.output_dir), pad_token_id=tokenizer.pad_token_id, seed=cfg.run.seed)
    return _run_pairs(
        cfg,
        "rm",
        cfg.rm.max_num_steps,
        rm_train,
        KEY_METRICS,
        "val/accuracy",
        source=source,
        tokenizer=tokenizer,
        data=data,
    )


def run_eval(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.evaluate import SAMPLES_FILE, format_examples, write_samples
    from mrl.algorithms.mixed_rollouts import validate_all
    from mrl.data.tasks import load_task_data
    from mrl.environments.registry import build_run_environment

    start = time.perf_counter()
    data = load_task_data(cfg, val_source=cfg.eval.data)
    if not data.val:
        raise ConfigError(
            "nothing to evaluate",
            key="eval.data",
            fix="set eval.data (or data.val) to a problem/answer file (jsonl or parquet)",
        )
    source = resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, source)
    _check_val_prompts(cfg, tokenizer, data)
    runtime = _started(cfg, total_steps=1, policy=False, source=source, tokenizer=tokenizer)
    env = build_run_environment(cfg)
    try:
        with explained_failures(cfg):
            assert runtime.engine is not None  # started: mrl eval starts an engine and no policy
            metrics, result = validate_all(cfg, runtime.engine, runtime.tokenizer, env, data)
    finally:
        env.shutdown()
        runtime.shutdown()
    if not metrics:
        raise ConfigError("no evaluation prompt fits data.max_prompt_length", key="data.max_prompt_length")
    out = Path(cfg.run.output_dir)
    if result is not None:  # single-turn samples (a resource server's episodes are counted, not written)
        samples = write_samples(out / SAMPLES_FILE, result.samples)
        print(f"examples ({len(result.samples)} samples in {samples}):\n{format_examples(result.samples)}")
    for name, value in metrics.items():
        print(f"{name}: {value:.4f}")
    summary = {"algorithm": "eval", "seconds": time.perf_counter() - start, "final": metrics}
    save_summary(out, summary)
    return summary


def run_score(cfg: MrlConfig, input_path: str, out_path: str) -> dict[str, float]:
    """`mrl score`: logprobs of every row of `input_path` under the policy, in any parallel layout."""
    from mrl.algorithms.score import read_inputs, score_rows, write_scores

    if not Path(input_path).is_file():
        raise FileNotFoundError(f"--input {input_path}: no such file")
    check_output_file(out_path, "--out")  # before the scoring, whose work a bad path would lose
    source = resolve_model(cfg)
    tokenizer = load_tokenizer(cfg, source)
    rows = read_inputs(input_path, tokenizer, cfg.policy.max_total_sequence_length)
    check_score_rows(input_path, rows, model_vocab_size(source.config_dir, tokenizer))
    runtime = _started(cfg, total_steps=1, engine=False, source=source, tokenizer=tokenizer)
    try:
        with explained_failures(cfg):
            pad = runtime.tokenizer.pad_token_id if runtime.tokenizer.pad_token_id is not None else 0
            scored, routing = score_rows(runtime.policy, rows, pad)
    finally:
        runtime.shutdown()
    return write_scores(out_path, rows, scored, routing)


def with_hub_ids(run: Callable[[MrlConfig], dict[str, Any]]) -> Callable[[MrlConfig], dict[str, Any]]:
    """`run` on the config with its hub ids resolved to snapshot folders first (mrl/app/hub_ids.py); what they
    resolved to goes into summary.json as `hub`."""

    @functools.wraps(run)
    def resolved_run(cfg: MrlConfig) -> dict[str, Any]:
        cfg, resolved = resolve_hub_ids(cfg)
        summary = run(cfg)
        if resolved:
            summary["hub"] = resolved
            save_summary(Path(cfg.run.output_dir), summary)
        return summary

    return resolved_run


RUNNERS = {
    name: with_hub_ids(run)
    for name, run in {"grpo": run_grpo, "sft": run_sft, "dpo": run_dpo, "rm": run_rm, "eval": run_eval}.items()
}


def run_command(name: str, cfg: MrlConfig) -> dict[str, Any]:
    """`mrl <name>` (grpo, sft, dpo, rm, eval): the run, then the lines naming where its results are (also after a
    guard stopped it: what it left, its summary.json saying why)."""
    from mrl.algorithms.guards import TrainingStopped

    check_output_folders(cfg, trains=name != "eval")
    try:
        summary = RUNNERS[name](cfg)
    except TrainingStopped:
        print(run_report(cfg, stopped=True), flush=True)
        raise
    print(run_report(cfg), flush=True)
    return summary
