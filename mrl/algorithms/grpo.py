"""GRPO: the single-controller loop, reading like the algorithm.

Objective (Shao et al. 2024, with the choices of mrl.objectives.loss and .advantages): for each prompt sample a
group of G responses from the current policy (the engine, refitted after every step), score them with a verifiable
reward, advantage A_i = group-normalised reward, and minimise the clipped surrogate
    L = -mean_t min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_k(pi || pi_ref),  r_t = pi/pi_old
over the batch, split into `policy.train_global_batch_size` rows per optimizer step. pi_old is the trainer's
logprob of the sampled tokens before the step's updates (its difference with the engine's logprobs is the
train/inference mismatch, logged every step as train/token_mult_prob_error and train/gen_kl_error); a step of one
update takes it from its training forward, one forward fewer. With loss.ratio_level = sequence, r is GSPO's one
ratio per sequence, the geometric mean of its token ratios, clipped per sequence (mrl.objectives.loss).

Departures: a group whose rewards are all equal has zero advantage; with grpo.dynamic_sampling such groups are
dropped instead of refilled (DAPO refills; here the step is just smaller). With grpo.max_off_policy_steps = 1 the
samples come from the policy one update older than pi_old (generation overlaps training, mrl/algorithms/ahead.py);
the loss's importance weights pi_old / pi_engine correct for it (loss.importance_sampling, required then).
Validation (before the first step, every grpo.val_every steps and after the last) samples the held-out problems
with the eval settings; a run without validation data skips it and says so once. An update whose loss or gradients
are not finite is skipped, and so is the refit after a step of only such updates (mrl/algorithms/guards.py). A
step that could learn nothing (every prompt too long, every group's rewards equal, no sample kept) warns with the
cause and the fix; grpo.max_idle_steps such steps in a row stop the run, exit 2 (mrl/algorithms/health.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

from mrl.algorithms.agent import agent_rollouts, validate_episodes
from mrl.algorithms.ahead import RolloutsAhead
from mrl.algorithms.evaluate import validate, write_samples
from mrl.algorithms.guards import NonFiniteGuard
from mrl.algorithms.health import IdleGuard, env_reads_answers, health_metrics, step_causes
from mrl.algorithms.interfaces import LoopCheckpoints, Workers
from mrl.algorithms.rollout import Rollouts, generate_and_score
from mrl.config.schema import MrlConfig
from mrl.data.dataloader import PromptDataLoader
from mrl.data.tasks import TaskData, encode_prompts
from mrl.environments.base import Environment
from mrl.environments.server_env import ServerEnvironment
from mrl.inference.factory import sampling_config
from mrl.logging.metrics import MetricsLogger
from mrl.objectives.advantages import dynamic_sampling_keep, grpo_advantages, overlong_penalty
from mrl.objectives.loss import GENERATION_LOGPROBS, PREV_LOGPROBS, REF_LOGPROBS, GRPOLoss
from mrl.objectives.mismatch import mismatch_metrics
from mrl.policy.interface import RankBatch

KEY_METRICS = ("train/reward", "train/token_mult_prob_error", "val/accuracy", "timing/step")


def training_rows(rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor, dp_size: int) -> RankBatch:
    """The kept samples as policy rows; advantages broadcast over tokens. Rows are added with an all-zero loss mask
    until the count divides the data-parallel size (they change neither loss nor gradient)."""
    kept = keep.nonzero().squeeze(1)
    index = torch.cat([kept, kept[:1].repeat(-len(kept) % dp_size)])
    mask = rollouts.loss_mask[index].clone()
    mask[len(kept) :] = 0
    adv = advantages[index][:, None].expand_as(mask).contiguous()
    lengths = None if rollouts.lengths is None else rollouts.lengths[index]
    routing = None if rollouts.routing is None else rollouts.routing[index]  # router replay's engine choices
    return RankBatch(
        rollouts.input_ids[index],
        mask,
        {"advantages": adv, GENERATION_LOGPROBS: rollouts.generation_logprobs[index]},
        lengths=lengths,
        routing=routing,
    )


def run_validation(cfg: MrlConfig, workers: Workers, env: Environment, data: TaskData, step: int) -> dict[str, float]:
    """Validation metrics of the current policy (its samples go to <run.output_dir>/val_samples/step_<N>.jsonl;
    multi-turn episodes: their mean reward and the fraction of reward 1, no samples file). Both wake the engine;
    it sleeps again after (colocated: the policy trains or saves next); not after a failure, which ends the run (a
    sleep of a dead engine would report its death in 'finish_generation' instead of where it died)."""
    if isinstance(env, ServerEnvironment):
        metrics = validate_episodes(cfg, workers, env, data)
        workers.engine.finish_generation()
        return metrics
    result = validate(cfg, workers.engine, env, workers.tokenizer, data)
    workers.engine.finish_generation()
    if result is None:
        return {}
    write_samples(Path(cfg.run.output_dir) / "val_samples" / f"step_{step}.jsonl", result.samples)
    return result.metrics


def produce_rollouts(
    cfg: MrlConfig,
    workers: Workers,
    env: Environment,
    data: TaskData,
    problems,
    step: int,
    logger: MetricsLogger,
    policy_version: int,
) -> tuple[Rollouts, dict[str, float]]:
    """Step `step`'s samples from the engine (which holds the weights after step `policy_version`), scored."""
    m: dict[str, float] = {}
    problems, prompts = encode_prompts(problems, workers.tokenizer, data.template, cfg)
    sampling = sampling_config(cfg, step, turn_end_id=data.template.turn_end_id(workers.tokenizer))
    with logger.timer("generation", m):
        workers.engine.prepare_for_generation()  # colocated on GPUs: the engine takes its memory back
        if isinstance(env, ServerEnvironment):  # multi-turn episodes against a resource server
            rollouts, env_metrics = agent_rollouts(
                env, workers.engine, workers.tokenizer, data.template, problems, prompts, sampling
            )
            m.update(env_metrics)
        else:
            rollouts = generate_and_score(workers.engine, env, workers.tokenizer, problems, prompts, sampling)
        workers.engine.finish_generation(refit_follows=True)  # ... and releases it while the policy trains
    rollouts.policy_version = policy_version
    m["train/prompt_tokens_max"] = float(max((len(p) for p in prompts), default=0))
    return rollouts, m


def learn(
    cfg: MrlConfig, workers: Workers, rollouts: Rollouts, step: int, loss_fn: GRPOLoss, logger: MetricsLogger
) -> dict[str, float]:
    """reward -> advantage -> logprobs -> train on step `step`'s rollouts. Returns the step's training metrics."""
    m: dict[str, float] = {}
    n = cfg.grpo.num_generations_per_prompt
    with logger.timer("reward", m):
        rewards = rollouts.rewards
        if cfg.grpo.overlong_buffer:
            rewards = rewards + overlong_penalty(
                rollouts.response_lengths,
                max_length=cfg.generation.max_new_tokens,
                buffer=cfg.grpo.overlong_buffer,
                penalty=cfg.grpo.overlong_penalty,
            )
        grouped = rewards.view(-1, n)  # [P, G]
        advantages = grpo_advantages(
            grouped, leave_one_out=cfg.grpo.leave_one_out, normalize_std=cfg.grpo.normalize_std
        ).view(-1)
        keep = _groups_kept(grouped, cfg.grpo.dynamic_sampling).repeat_interleave(n)
        keep &= rollouts.loss_mask.sum(dim=1) > 0
        batch = training_rows(rollouts, advantages, keep, workers.policy.data_parallel_size)
    m.update(_rollout_metrics(rollouts, keep))
    m.update(health_metrics(rollouts, grouped, reads_answers=env_reads_answers(cfg)))
    m["train/staleness"] = float(step - 1 - rollouts.policy_version)  # updates between generating and training
    if not bool(keep.any()):  # nothing to learn from (every group uniform, or every sample lost): no update
        return m
    mismatch: dict[str, float] = {}
    with logger.timer("logprobs", m):
        if len(batch) > _rows_per_update(cfg, workers):  # pi_old must stay fixed over the step's updates
            batch.token_data[PREV_LOGPROBS] = workers.policy.logprobs(batch)
            mismatch = mismatch_metrics(
                batch.token_data[GENERATION_LOGPROBS], batch.token_data[PREV_LOGPROBS], batch.loss_mask
            )
        if loss_fn.needs_reference:
            batch.token_data[REF_LOGPROBS] = workers.policy.logprobs(batch, reference=True)
    with logger.timer("train", m):
        train = _train_in_minibatches(cfg, workers, batch, loss_fn)
    m.update({f"train/{k}": v for k, v in train.items()})
    # One update per step: pi_old is the training forward's own logprobs (the policy has not moved yet; no second
    # forward), and the mismatch is the loss's (token_mult_prob_error / gen_kl_error weighted like the loss: per
    # sequence at sequence level). Several updates: the per-token means over the batch before any update.
    # Asynchronous: they measure the engine/trainer mismatch plus one update of staleness.
    m.update({f"train/{k}": v for k, v in mismatch.items() if k != "num_tokens"})
    return m


def refit_engine(
    workers: Workers, logger: MetricsLogger, on_sent: Callable[[], None] | None = None
) -> dict[str, float]:
    """Stream the policy's weights into the engine; the refit's metrics (`on_sent`: `Workers.refit`'s)."""
    m: dict[str, float] = {}
    with logger.timer("refit", m):
        refit = workers.refit(on_sent)
    m.update({f"train/refit_{k.split('/')[1]}": v for k, v in refit.as_metrics().items() if k != "timing/refit"})
    return m


def _rollout_metrics(rollouts: Rollouts, keep: torch.Tensor) -> dict[str, float]:
    return {
        "train/reward": float(rollouts.rewards.mean()),
        "train/reward_errors": float(rollouts.num_reward_errors),
        "train/response_length": float(rollouts.response_lengths.float().mean()),
        "train/sequence_length_max": float(
            rollouts.input_ids.shape[1] if rollouts.lengths is None else rollouts.lengths.max()
        ),
        "train/truncated_fraction": float(rollouts.truncated.float().mean()),
        "train/prompts_rejected": float(rollouts.num_prompts_rejected),
        "train/kept_samples": float(keep.sum()),
    }


def _groups_kept(grouped_rewards: torch.Tensor, dynamic_sampling: bool) -> torch.Tensor:
    """[P] bool: the groups trained on; with dynamic sampling only those whose rewards are not all equal."""
    if not dynamic_sampling:
        return torch.ones(len(grouped_rewards), dtype=torch.bool)
    keep = torch.zeros(len(grouped_rewards), dtype=torch.bool)
    keep[dynamic_sampling_keep(grouped_rewards)] = True
    return keep


def _rows_per_update(cfg: MrlConfig, workers: Workers) -> int:
    """Rows of one optimizer step: `policy.train_global_batch_size`, a multiple of the data-parallel size."""
    dp = workers.policy.data_parallel_size
    return max(cfg.policy.train_global_batch_size, dp) // dp * dp


def _train_in_minibatches(cfg: MrlConfig, workers: Workers, batch: RankBatch, loss_fn: GRPOLoss) -> dict[str, float]:
    """One optimizer step per `policy.train_global_batch_size` rows; metrics averaged over the steps. The batch's
    rows are a multiple of the data-parallel size (`training_rows`), and so is every slice of it."""
    size = _rows_per_update(cfg, workers)
    steps = [batch.slice(i, i + size) for i in range(0, len(batch), size)]
    steps = [s for s in steps if s.loss_mask.sum() > 0]
    results = [workers.policy.train(s, loss_fn, temperature=1.0) for s in steps]
    # a metric some steps lack is the mean of those that have it (the routing disagreement: the first step's alone)
    keys = dict.fromkeys(k for r in results for k in r)
    return {k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in keys} | {
        "optimizer_steps": float(len(results))
    }


def grpo_train(
    cfg: MrlConfig,
    workers: Workers,
    env: Environment,
    data: TaskData,
    logger: MetricsLogger,
    ckpt: LoopCheckpoints,
    *,
    val_env: Environment | None = None,
) -> dict[str, float]:
    """The whole GRPO run (resumes from the newest checkpoint when there is one). Returns the final metrics.
    `val_env` scores validation (default `env`; with a reward model as the training reward, the task's verifier).
    `grpo.max_off_policy_steps: 1` generates step n+1 while step n trains (mrl/algorithms/ahead.py)."""
    val_env = val_env or env
    loader = PromptDataLoader(data.train, cfg.grpo.num_prompts_per_step, seed=cfg.run.seed)
    loss_fn = GRPOLoss(**cfg.loss.model_dump())  # loss.* are GRPOLoss's fields
    last = cfg.grpo.max_num_steps
    if not data.val:
        print("[mrl] no validation problems (data.val / eval.data): validation is skipped", file=sys.stderr)
    state = ckpt.resume_newest()
    start = int(state["step"]) if state else 0
    if state:
        loader.load_state_dict(state["dataloader"])
        workers.refit()  # the engine gets the resumed weights
    else:
        logger.log(run_validation(cfg, workers, val_env, data, step=0), step=0)

    def produce(step: int, problems, version: int) -> tuple[Rollouts, dict[str, float]]:
        return produce_rollouts(cfg, workers, env, data, problems, step, logger, version)

    ahead = (
        RolloutsAhead(produce, lambda on_sent: refit_engine(workers, logger, on_sent), engine_version=start)
        if cfg.grpo.max_off_policy_steps
        else None
    )
    if ahead is not None and state:
        ahead.load_state_dict(state.get("in_flight"))
    final: dict[str, float] = {}
    guard = NonFiniteGuard(cfg.policy.max_nonfinite_steps)
    idle = IdleGuard(cfg.grpo.max_idle_steps)
    try:
        for step in range(start + 1, last + 1):
            t0 = time.perf_counter()
            if ahead is None:
                rollouts, metrics = produce(step, next(loader), step - 1)
            else:
                rollouts, metrics = ahead.take(step, lambda: next(loader))
            done = step == last or loader.passes_done(cfg.grpo.max_num_epochs)
            if ahead is not None and not done:  # step + 1 generates (from the weights before this step) ...
                ahead.start(step + 1, next(loader), policy_version=step - 1)
            metrics.update(learn(cfg, workers, rollouts, step, loss_fn, logger))  # ... while this step trains
            skipped = guard.observe(step, metrics)  # a non-finite step changed no weight: nothing to refit
            causes = step_causes(cfg, metrics, rollouts)
            idle.observe(step, causes)
            metrics["train/health_warnings"] = float(len(causes))
            metrics["train/idle"] = float(any(cause.idle for cause in causes))
            if ahead is None and not skipped:
                metrics.update(refit_engine(workers, logger))
            if done or (cfg.grpo.val_every and step % cfg.grpo.val_every == 0):
                if ahead is not None:
                    metrics.update(ahead.update_engine(step))
                metrics.update(run_validation(cfg, workers, val_env, data, step))
            metrics["train/engine_restarts"] = float(workers.engine_restarts)
            metrics["timing/step"] = time.perf_counter() - t0
            logger.log(metrics, step=step)
            final = metrics
            guard.stop_if_exhausted()
            idle.stop_if_exhausted()  # before the save: an idle step's checkpoint would only renumber the start
            if ckpt.due(step, last, final=done):
                in_flight = ahead.state_dict() if ahead is not None else None
                ckpt.save(step, {"dataloader": loader.state_dict(), "in_flight": in_flight}, metrics)
            if ckpt.stops_after(step, done=done):
                break
    finally:
        if ahead is not None:
            ahead.close()
    return final
