"""What a command reads, checked in the controller before any worker starts: a mistake in a file the user named ends
the command with a `ConfigError` (exit 2, one message naming the key, what was found and the fix), not with a
worker's traceback after the workers and the engine have started (tens of seconds on CPU, minutes on a cluster).

    the data           data.train / data.val / eval.data, read in full: a file that is empty, has no valid JSON line,
                       lacks the configured columns or is in a format mrl does not read (mrl/data/datasets.py,
                       preferences.py). Each command loads its data before its workers start; `mrl run` also reads
                       every stage still to run before the first starts (`check_stage`), and `mrl submit` before
                       it queues the job (`check_data`)
    the model          a family mrl builds (`model_source.classify_model_path`)
    the tokenizer      policy.tokenizer, else the model folder, holds vocabulary files (`check_tokenizer_folder`);
                       the reward model, critic and teacher share the policy's (`check_tokenizers`)
    the engine's model vLLM's CPU attention has kernels for some head sizes only, and vLLM refuses a context longer
                       than the model's max_position_embeddings (`check_engine_model`)
    mrl score --input  a row to score, and token ids the model's vocabulary holds (`check_score_rows`)
    a step's batch     enough usable training rows for one step (`check_fills_a_batch`)
    the results        run.output_dir, and for a training command checkpointing.dir and logger.log_dir, are folders
                       that can be written (or made: not made here), mrl score --out a file (`check_output_folders`,
                       `check_output_folder`, `check_output_file`)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from mrl.app.model_source import classify_model_path
from mrl.checkpoint.megatron import HF_SUBDIR
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.data import hub
from mrl.data.tokenizers import vocabulary_files
from mrl.inference.factory import engine_context_length
from mrl.inference.vllm_backend import CPU_ATTENTION_HEAD_SIZES


def check_output_folder(folder: str | Path, key: str = "run.output_dir", what: str = "results") -> None:
    """`folder` is one a command can write its `what` into, checked without leaving anything: a folder, or one
    that can be made (a folder made and removed again in its nearest existing parent)."""
    import tempfile

    target = Path(folder).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        os.rmdir(tempfile.mkdtemp(prefix=".mrl-write-check-", dir=existing))
    except OSError as error:  # a file in the way, a read-only file system, no permission, /proc
        raise ConfigError(
            f"{what} cannot be written there: "
            + (
                f"{existing} is a file"
                if not existing.is_dir()
                else f"nothing can be made in {existing} ({error.strerror or error})"
            ),
            key=key,
            given=str(folder),
            fix=f"set {key} to a folder you can write (one that exists, or one that can be made)",
        ) from error


def check_output_folders(cfg: MrlConfig, *, trains: bool) -> None:
    """The folders a command writes into: run.output_dir, and for a training command (`trains`) checkpointing.dir
    when it saves checkpoints and logger.log_dir when metrics.jsonl or TensorBoard events go there. Said before any
    worker starts, not at the first save or the first metrics line after the workers and a step."""
    check_output_folder(cfg.run.output_dir)
    if not trains:
        return
    if cfg.checkpointing.enabled:
        check_output_folder(cfg.checkpointing.dir, "checkpointing.dir", "checkpoints")
    if cfg.logger.jsonl or cfg.logger.tensorboard:
        check_output_folder(cfg.logger.log_dir, "logger.log_dir", "logs")


def check_output_file(path: str | Path, key: str) -> None:
    """`path` is a file a command can write: not a folder, and its folder exists or can be made."""
    if Path(path).is_dir():
        raise ConfigError(
            "it is a folder: name the file to write",
            key=key,
            given=str(path),
            fix=f"e.g. {key} {Path(path) / 'scores.jsonl'}",
        )
    check_output_folder(Path(path).parent, key)


def check_fills_a_batch(rows: int, batch: int, *, batch_key: str, what: str, data_key: str = "data.train") -> None:
    """A step takes `batch` of the `rows` usable training rows (whole batches: an epoch's tail is dropped), so fewer
    rows than one batch train nothing: said before any worker starts, naming both keys."""
    if rows >= batch:
        return
    raise ConfigError(
        f"{data_key} has {rows} usable {what}, fewer than one step takes",
        key=batch_key,
        given=batch,
        allowed=f"at most {rows}",
        fix=f"add rows to {data_key}, or lower {batch_key}",
    )


def check_tokenizer_folder(folder: str | Path, key: str) -> None:
    """`folder` holds a tokenizer's vocabulary. Without one transformers 5 builds an empty tokenizer of one token,
    and the run fails later on something else (the chat template), or trains on nothing (a loss of 0)."""
    path = Path(folder)
    if not path.exists() and hub.parse_hub_id(str(folder)) is not None:
        return  # a hub id (a run resolves its own before this: mrl/app/hub_ids.py)
    if not path.is_dir():
        raise ConfigError(
            "there is no such folder",
            key=key,
            given=str(folder),
            fix="pass a folder holding the tokenizer files (tokenizer.json, or vocab.json + merges.txt, "
            "or tokenizer.model), or a hub id (org/name[@revision])",
        )
    if vocabulary_files(path):
        return
    held = sorted(p.name for p in path.iterdir())
    raise ConfigError(
        f"{folder} holds no tokenizer: none of tokenizer.json, vocab.json, vocab.txt, *.model, "
        f"*.tiktoken (it holds {', '.join(held[:8]) or 'nothing'}{', ...' if len(held) > 8 else ''})",
        key=key,
        given=str(folder),
        fix=f"copy the tokenizer files of the model it came from into {folder}, or set "
        "policy.tokenizer to a folder (or hub id) that has them",
    )


def attention_head_size(hf_config: dict) -> Optional[int]:
    """The per-head size of the model's attention (config.json's head_dim, else hidden_size / heads); None for
    multi-latent attention (vLLM serves it with another kernel, of its own limits) or a config that does not say."""
    if hf_config.get("kv_lora_rank"):
        return None
    if isinstance(hf_config.get("head_dim"), int):
        return hf_config["head_dim"]
    hidden, heads = hf_config.get("hidden_size"), hf_config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def engine_on_cpu(cfg: MrlConfig) -> bool:
    """A vLLM engine that will run on CPU: this process sees no CUDA device (the rule mrl/app/runtime.py starts a run
    by: no CUDA here, a CPU run)."""
    return cfg.generation.backend == "vllm" and not torch.cuda.is_available()


def check_engine_model(cfg: MrlConfig, hf_config: dict) -> None:
    """What vLLM refuses of this model, refused here before any worker starts (both fail the same way on every
    re-run): a context longer than the model's (`check_context_length`) and, on CPU, a head size its attention has
    no kernel for (`CPU_ATTENTION_HEAD_SIZES`: the engine starts, then fails inside its first generation)."""
    check_context_length(cfg, hf_config)
    size = attention_head_size(hf_config)
    if size is None or size in CPU_ATTENTION_HEAD_SIZES or not engine_on_cpu(cfg):
        return
    how = (
        "config.json's head_dim"
        if "head_dim" in hf_config
        else f"hidden_size {hf_config.get('hidden_size')} / {hf_config.get('num_attention_heads')} heads"
    )
    build = cfg.policy.build
    raise ConfigError(
        f"the model's attention head size is {size} ({how}), and vLLM's CPU attention has no kernel for it",
        key="policy.build.num_attention_heads" if build is not None else "policy.model_name",
        given=build.num_attention_heads if build is not None else cfg.policy.model_name,
        allowed=f"a model of head size {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}",
        fix=(
            "a hidden_size / num_attention_heads giving one of these"
            if build is not None
            else "start from a model of one of these head sizes"
        )
        + "; or generation.backend=megatron (the policy's own model generates, at any head size); "
        "or GPUs",
    )


def check_context_length(cfg: MrlConfig, hf_config: dict) -> None:
    """vLLM's engine refuses a `max_model_len` above the model's `max_position_embeddings` at its start (a
    ValidationError inside the worker; vLLM's override is an environment variable that accepts wrong outputs)."""
    limit = hf_config.get("max_position_embeddings")
    context = engine_context_length(cfg)
    if cfg.generation.backend != "vllm" or not isinstance(limit, int) or context <= limit:
        return
    key = "generation.vllm.max_model_len" if cfg.generation.vllm.max_model_len else "policy.max_total_sequence_length"
    raise ConfigError(
        f"the engine's context of {context} tokens is longer than the model's: its config.json has "
        f"max_position_embeddings {limit}, and vLLM refuses a longer one",
        key=key,
        given=context,
        allowed=f"at most {limit}",
        fix=f"set {key}={limit} or less (prompt + response"
        + (
            f"; and generation.max_new_tokens below it, now {cfg.generation.max_new_tokens}"
            if cfg.generation.max_new_tokens >= limit
            else ""
        )
        + "), or start from a model of a longer context",
    )


def check_stage(cfg: MrlConfig, algorithm: str) -> None:
    """What a stage of a staged recipe reads that exists before the first stage starts: its data files (a stage
    naming a hub id reads its data when it starts), and the engine's model where known (a random model's size, or a
    model folder that exists; an earlier stage's export keeps the architecture the first stage was checked with)."""
    check_output_folders(cfg, trains=algorithm != "eval")
    if not any(hub.parse_hub_id(source) for _, source in data_sources(cfg, algorithm)):
        check_data(cfg, algorithm)
    config = _known_model_config(cfg)
    if algorithm in ("grpo", "eval") and config is not None:
        check_engine_model(cfg, config)


@contextlib.contextmanager
def _quiet_bad_rows() -> Any:
    """No warning of skipped rows while checking: the stage's command reads its data again and says it then, once."""
    data_logger = logging.getLogger("mrl.data")
    level = data_logger.level
    data_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        data_logger.setLevel(level)


def data_sources(cfg: MrlConfig, algorithm: str) -> list[tuple[str, str]]:
    """(key, value) of each data file, dataset folder or hub id the command `algorithm` reads (`check_data`)."""
    data = cfg.data
    if algorithm in ("dpo", "rm"):
        pairs = [] if data.arith is not None else [("data.train", data.train), ("data.val", data.val)]
    elif data.sources:
        pairs = [
            (f"data.sources[{i}].{name}", path)
            for i, source in enumerate(data.sources)
            for name, path in (("train", source.train), ("val", source.val))
        ]
    elif data.arith is not None:
        pairs = []
    else:
        evaluated = algorithm in ("grpo", "eval") and cfg.eval.data
        pairs = [("data.train", data.train), ("eval.data", cfg.eval.data) if evaluated else ("data.val", data.val)]
    return [(key, value) for key, value in pairs if value]


def check_data(cfg: MrlConfig, algorithm: str) -> None:
    """The data the command `algorithm` reads, read in full as it reads it (errors as there), without its warnings
    of skipped rows (`_quiet_bad_rows`)."""
    from mrl.data.preferences import load_preferences
    from mrl.data.tasks import load_task_data

    with _quiet_bad_rows():
        if algorithm not in ("dpo", "rm"):
            load_task_data(cfg, val_source=cfg.eval.data if algorithm in ("grpo", "eval") else None)
            return
        for name, source in (("train", cfg.data.train), ("val", cfg.data.val)):
            if source and cfg.data.arith is None:
                load_preferences(source, split="train" if name == "train" else "test", key=f"data.{name}")


def _known_model_config(cfg: MrlConfig) -> Optional[dict]:
    """The policy model's config when it is known before the run: a random model's size (`policy.build`), or the
    config.json of a model folder that exists (HF, or a Megatron folder's hf/); else None."""
    build = cfg.policy.build
    if build is not None:
        return {"hidden_size": build.hidden_size, "num_attention_heads": build.num_attention_heads}
    if not cfg.policy.model_name:
        return None
    folder = Path(cfg.policy.model_name)
    for path in (folder / "config.json", folder / HF_SUBDIR / "config.json"):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def check_score_rows(input_path: str, rows: Sequence[Any], vocab_size: Optional[int] = None) -> None:
    """`mrl score` has a row to score (`rows`: mrl.algorithms.score's, each with its ids or its error): an unusable
    row is reported in the output and skipped, but a file with none to score is a mistake. So is a token id outside
    the model's vocabulary (`vocab_size`: its embedding's rows), which a worker would meet as an index error: ids made
    with another tokenizer, whose scores would mean nothing."""
    if vocab_size is not None:
        _check_score_vocabulary(input_path, rows, vocab_size)
    if any(row.ids is not None for row in rows):
        return
    shapes = '{"text": ...}, {"prompt": ..., "completion": ...} or {"input_ids": [...]}, one JSON object per line'
    if not rows:
        raise ConfigError(
            f"{input_path} holds no rows: it is empty",
            key="--input",
            allowed=shapes,
            fix="pass a jsonl file of rows to score",
        )
    raise ConfigError(
        f"{input_path}: none of its {len(rows)} rows can be scored (first, line {rows[0].index + 1}: {rows[0].error})",
        key="--input",
        allowed=shapes,
        fix="write the rows in one of these shapes",
    )


def _check_score_vocabulary(input_path: str, rows: Sequence[Any], vocab_size: int) -> None:
    outside = [r for r in rows if r.ids is not None and not 0 <= min(r.ids) <= max(r.ids) < vocab_size]
    if not outside:
        return
    first = outside[0]
    bad = next(t for t in first.ids if not 0 <= t < vocab_size)
    more = f" (and {len(outside) - 1} more rows)" if len(outside) > 1 else ""
    raise ConfigError(
        f"{input_path} line {first.index + 1}: token id {bad} is outside the model's vocabulary of {vocab_size} "
        f"tokens{more}",
        key="--input",
        allowed=f"token ids 0 to {vocab_size - 1}",
        fix="write input_ids with this model's tokenizer, or score them under the model whose tokenizer made them "
        "(--model)",
    )


def model_vocab_size(config_dir: Path, tokenizer: Any) -> int:
    """Rows of the model's token embedding: its config.json's vocab_size (of the text model, for a multimodal
    one), else the tokenizer's size."""
    config = json.loads((Path(config_dir) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else len(tokenizer)


def _check_same_tokenizer(path: str, key: str, what: str, tokenizer: Any, fix: str) -> None:
    """A model that reads the policy's token ids (`what`, at config `key`) must share its vocabulary. Checked before
    any worker starts."""
    from mrl.data.tokenizers import load_tokenizer as load_folder_tokenizer

    folder = classify_model_path(path, key=key).config_dir
    check_tokenizer_folder(folder, key)
    theirs, ours = load_folder_tokenizer(folder).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differing = sorted(set(theirs.items()) ^ set(ours.items()), key=str)[:3]
        raise ConfigError(
            f"the {what}'s tokenizer differs from the policy's ({len(theirs)} tokens against {len(ours)}; "
            f"e.g. {differing}); it reads the policy's token ids",
            key=key,
            given=str(folder),
            fix=fix,
        )


def check_tokenizers(cfg: MrlConfig, tokenizer: Any) -> None:
    """The reward model (env.reward_model), the critic (ppo.critic.model_name) and the teacher (distillation.teacher)
    read the policy's token ids."""
    if cfg.env.reward_model is not None:
        _check_same_tokenizer(
            cfg.env.reward_model.model,
            "env.reward_model.model",
            "reward model",
            tokenizer,
            fix="train the reward model from the same base model (same tokenizer)",
        )
    if cfg.grpo.advantage_estimator == "gae" and cfg.ppo.critic.model_name:
        _check_same_tokenizer(
            cfg.ppo.critic.model_name,
            "ppo.critic.model_name",
            "critic",
            tokenizer,
            fix="start the critic from a reward model of the same base model, or leave ppo.critic.model_name unset",
        )
    if cfg.distillation is not None:
        _check_same_tokenizer(
            cfg.distillation.teacher,
            "distillation.teacher",
            "teacher",
            tokenizer,
            fix="distil from a teacher of the student's family with the same tokenizer (logprobs of other token "
            "ids cannot be compared token by token)",
        )
