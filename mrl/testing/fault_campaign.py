"""A fault campaign: GRPO runs, each with one fault of a random kind at a random moment, and a table of outcomes
(benchmarks/fault_campaign.py is its command line; tests/faults runs a small one).

The run is the fault suite's (tests/faults): the embedded recipe's 1-digit task from a policy SFT-warmed once, a
checkpoint every step, scored by the math environment's verifier actors (math-verify in a Ray actor pool). An
uninterrupted run of the same seed is the reference: its wall time T, and how long a process of each kind lived in it
(its workers leave their pids under MRL_FAULT_PIDS, which the campaign watches). Each trial starts the same command
and SIGKILLs
    engine      a vLLM engine worker process (`VllmEngineWorker`)
    policy      a policy worker process (`PolicyWorker`)
    verifier    a verifier actor process (`VerifierActor`)
    controller  the controller and every process it started (its process group), then runs the command again
at a moment uniform over that kind's life: for a worker, a time drawn from [0, L) after the first process of its kind
started, L its kind's life in the reference (first start to last sight); for the controller, a time drawn from
[0, T) after the command started. (Start-up is most of a short run's wall time on a slow machine and the verifiers
start only with the steps, so moments drawn over T alone mostly found no victim: docs/measurements.md, Fault
campaigns.) Then the trial waits for the command's end (`steps_logged_at_fault`
says how far the run was) (at most 3T + 180 s, else `hung`).
Outcomes:
    survived         exit 0 without a re-run
    stopped cleanly  exit 4 with the run's one message (`mrl: run failed: ...`, the command that resumes it) and no
                     traceback; the command is run again
    crashed          any other end, or a traceback in the output
    hung             the command did not end in time (killed)
    missed           nothing of that kind was alive at the moment (the run had ended, or never started one)
For every run that finished (at once or re-run), `exact` says whether each step's training metrics (`train/*`
but times and restart counts) equal the reference's: what the docs promise for seeded sampling and for a resume.
Trials go on until `--faults` faults have landed (a missed trial lands none). The campaign fails (exit 1) when a
trial crashed or hung, an engine or verifier death was not survived, or a finished run is not exact (`problems`).

    python benchmarks/fault_campaign.py --faults 50 --seed 0 [--kinds engine policy verifier controller] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mrl.distributed.faults import PIDS_ENV
from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl, training_metrics, warm_grpo_args

ROLES = {"engine": "VllmEngineWorker", "policy": "PolicyWorker", "verifier": "VerifierActor"}
KINDS = ("engine", "policy", "verifier", "controller")
#: The kinds whose death the run survives (replaced, the work redone); the others may stop it cleanly (exit 4).
SURVIVED = ("engine", "verifier")
OUTCOMES = ("survived", "stopped cleanly", "crashed", "hung", "missed")
POLL_S = 0.2  # how often the campaign looks for live workers


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=10, help="faults that land (missed trials do not count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps of each run")
    parser.add_argument("--json", metavar="FILE", help="also write every trial to FILE")
    return parser.parse_args(argv)


def grpo_args(warm: Path, out: Path, steps: int) -> list[str]:
    return warm_grpo_args(warm, out, f"grpo.max_num_steps={steps}", "env.kind=math", "env.num_workers=2")


def same_training(got: dict[int, dict], reference: dict[int, dict]) -> bool:
    """Every reference step logged with the same training metrics (times and restart counts aside)."""
    for step, row in reference.items():
        wanted = training_metrics(row, skip=("refit",))
        if step not in got or {k: got[step].get(k) for k in wanted} != wanted:
            return False
    return True


def _victim(kind: str, pids_dir: Path) -> int | None:
    """A live process of `kind` (the newest registered), or None."""
    live = []
    for path in pids_dir.glob(f"{ROLES[kind]}-*"):
        pid = int(path.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
            live.append((path.stat().st_mtime, pid))
        except OSError:
            continue
    return max(live)[1] if live else None


def observe(proc: subprocess.Popen, pids_dir: Path, timeout_s: float = 600) -> tuple[str, dict[str, float]]:
    """Wait for `proc` (started with MRL_FAULT_PIDS=`pids_dir`; a non-zero exit fails with the output's tail) while
    watching its workers: (its output, each kind's life in seconds: from its first process's start to the last moment
    one was seen alive). A kind never seen is absent."""
    seen: dict[str, tuple[float, float]] = {}
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(finish, proc, timeout_s)
        while not reader.done():
            now = time.monotonic()
            for kind in ROLES:
                if _victim(kind, pids_dir) is not None:
                    seen[kind] = (seen.get(kind, (now, now))[0], now)
            time.sleep(POLL_S)
        out = reader.result()
    return out, {kind: last - first for kind, (first, last) in seen.items()}


def _first_start(kind: str, proc: subprocess.Popen, pids_dir: Path, timeout_s: float) -> int | None:
    """Wait until a process of `kind` is alive (its pid); None when the command ended or `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        pid = _victim(kind, pids_dir)
        if pid is not None:
            return pid
        time.sleep(POLL_S)
    return None


def _wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def _steps_logged(out_dir: Path) -> int:
    """Training steps logged so far (step 0, the validation before the first step, is not one)."""
    try:
        return sum(step > 0 for step in metrics(out_dir / "logs"))
    except (OSError, ValueError):
        return 0


def _classify(code: int | None, out: str) -> str:
    if code is None:
        return "hung"
    if "Traceback (most recent call last)" in out:
        return "crashed"
    if code == 0:
        return "survived"
    if code == 4 and "mrl: run failed:" in out:  # one message, and the command that resumes (or starts again)
        return "stopped cleanly"
    return "crashed"


def trial(
    index: int, kind: str, offset: float, warm: Path, root: Path, steps: int, window: float, reference: dict[int, dict]
) -> dict:
    """One run with one fault: `offset` seconds after the command started (the controller) or after the first
    process of `kind` started (a worker kind)."""
    out_dir, pids = root / f"trial{index}", root / f"pids{index}"
    args = grpo_args(warm, out_dir, steps)
    started = time.monotonic()
    proc = mrl(*args, env={PIDS_ENV: str(pids)})
    record = {"trial": index, "kind": kind, "offset_s": round(offset, 2)}
    if kind != "controller" and _first_start(kind, proc, pids, 2 * window + 60) is None:
        ended = proc.poll()
        if ended is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        why = f"no {ROLES[kind]} started" + (f" (the run ended with exit {ended})" if ended is not None else "")
        return {**record, "delay_s": round(time.monotonic() - started, 2), "outcome": "missed", "why": why}
    time.sleep(offset)
    record["delay_s"] = round(time.monotonic() - started, 2)  # the fault's moment, from the command's start
    if proc.poll() is not None:
        _wait(proc, 10)
        return {**record, "outcome": "missed", "why": "the run had ended"}
    record["steps_logged_at_fault"] = _steps_logged(out_dir)  # = steps: the fault came after the last step
    if kind == "controller":
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every Ray process it started, at once
        proc.communicate()
        code, out = _wait(mrl(*args), 3 * window + 180)  # the operator's re-run
        outcome = _classify(code, out)
        outcome = "stopped cleanly" if outcome == "survived" else outcome  # killed, then resumed by the re-run
        return {
            **record,
            "outcome": outcome,
            "resumed": code == 0,
            "exact": code == 0 and same_training(metrics(out_dir / "logs"), reference),
            "tail": out[-1500:],
        }
    pid = _victim(kind, pids)
    if pid is None:  # no fault lands: the run is of no further use
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {**record, "outcome": "missed", "why": f"no {ROLES[kind]} alive"}
    os.kill(pid, signal.SIGKILL)
    code, out = _wait(proc, 3 * window + 180)
    outcome = _classify(code, out)
    record.update(outcome=outcome, pid=pid, exit=code)
    if outcome == "stopped cleanly":
        code, out2 = _wait(mrl(*args), 3 * window + 180)
        record["resumed"] = code == 0
        out += out2
    finished = code == 0
    record["exact"] = finished and same_training(metrics(out_dir / "logs"), reference)
    if outcome in ("crashed", "hung"):
        record["tail"] = out[-3000:]
    return record


def table(trials: list[dict], kinds: list[str]) -> str:
    counts = Counter((t["kind"], t["outcome"]) for t in trials)
    exact = Counter(t["kind"] for t in trials if t.get("exact"))
    finished = Counter(t["kind"] for t in trials if t["outcome"] in ("survived", "stopped cleanly"))
    lines = [f"{'fault':12}" + "".join(f"{o:>17}" for o in OUTCOMES) + f"{'exact / finished':>18}"]
    for kind in kinds:
        lines.append(
            f"{kind:12}"
            + "".join(f"{counts[kind, o]:17d}" for o in OUTCOMES)
            + f"{exact[kind]:>12d} / {finished[kind]}"
        )
    return "\n".join(lines)


def problems(trials: list[dict]) -> list[str]:
    """What the campaign promises and a trial broke: a crash or hang, an engine or verifier death not survived, a
    finished run whose training differs from the uninterrupted one."""
    found = []
    for t in trials:
        where = f"trial {t['trial']} ({t['kind']} at {t['delay_s']} s)"
        if t["outcome"] in ("crashed", "hung"):
            found.append(f"{where}: {t['outcome']}\n{t.get('tail', '')}")
        elif t["kind"] in SURVIVED and t["outcome"] == "stopped cleanly":
            found.append(f"{where}: stopped the run instead of being survived")
        elif t["outcome"] != "missed" and not t.get("exact"):
            found.append(f"{where}: {t['outcome']} but its training differs from the uninterrupted run's")
    return found


def campaign(
    warm: Path, root: Path, *, faults: int, seed: int, kinds=KINDS, steps: int = 6, twin: bool = True
) -> tuple[list[dict], float]:
    """Trials until `faults` faults landed (at most 2 * faults + 5 trials); (trials, window in seconds). The window
    and the kinds' lives are those of an uninterrupted run after the reference (`twin`: the first run fills the
    compile caches), or of the reference itself."""
    rng = random.Random(seed)
    window, lives = _uninterrupted(warm, root / "reference", steps)
    reference = metrics(root / "reference" / "logs")
    if twin:
        window, lives = _uninterrupted(warm, root / "window", steps)
        second = "equal to" if same_training(metrics(root / "window" / "logs"), reference) else "NOT equal to"
        print(f"[campaign] a second uninterrupted run is {second} the first")
    lives["controller"] = window
    unseen = [ROLES[kind] for kind in kinds if kind not in lives]
    if unseen:
        raise RuntimeError(
            f"no {', '.join(unseen)} registered in the uninterrupted run: its pid file is written by "
            "mrl.distributed.faults.register when MRL_FAULT_PIDS is set; a worker that no longer calls it cannot be "
            "a campaign's victim"
        )
    print(
        f"[campaign] uninterrupted run: {steps} steps in {window:.0f} s; faults uniform over each kind's life: "
        + ", ".join(f"{kind} [0, {lives[kind]:.0f}) s" for kind in kinds)
        + f" after its first start; seed {seed}",
        flush=True,
    )
    trials: list[dict] = []
    while sum(t["outcome"] != "missed" for t in trials) < faults and len(trials) < 2 * faults + 5:
        kind = rng.choice(list(kinds))
        offset = rng.uniform(0, lives[kind])
        result = trial(len(trials), kind, offset, warm, root, steps, window, reference)
        trials.append(result)
        late = result.get("steps_logged_at_fault") == steps
        print(
            f"[campaign] {result['trial']}: {kind} at {result['delay_s']:.1f} s -> {result['outcome']}"
            f"{' (exact)' if result.get('exact') else ''}{' ' + result['why'] if 'why' in result else ''}"
            f"{' (after the last step)' if late else ''}",
            flush=True,
        )
        if result["outcome"] in ("crashed", "hung"):
            print(result.get("tail", ""), flush=True)
    return trials, window


def _uninterrupted(warm: Path, out_dir: Path, steps: int) -> tuple[float, dict[str, float]]:
    """Run without a fault, watching its workers: (its wall time, each kind's life: `observe`)."""
    pids = out_dir.parent / f"pids-{out_dir.name}"
    start = time.monotonic()
    _, lives = observe(mrl(*grpo_args(warm, out_dir, steps), env={PIDS_ENV: str(pids)}), pids)
    return time.monotonic() - start, lives


def main(argv=None) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory(prefix="mrl-campaign-") as folder:
        root = Path(folder)
        finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={root / 'sft'}"))
        trials, window = campaign(
            root / "sft" / "final_hf", root, faults=args.faults, seed=args.seed, kinds=args.kinds, steps=args.steps
        )
    print(table(trials, args.kinds))
    if args.json:
        Path(args.json).write_text(json.dumps({"window_s": window, "seed": args.seed, "trials": trials}, indent=1))
    found = problems(trials)
    print(
        "\n".join(found)
        if found
        else "[campaign] no problem: nothing crashed or hung, every engine and verifier "
        "death survived, every finished run exact"
    )
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
