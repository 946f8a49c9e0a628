"""`kind: code`: each response's program run with its row's tests in a sandbox (sandbox.py), the reward what passed.

    response  -> the program: the last fenced block (```python ... ``` or ``` ... ```), else the whole text; a row
                 with an `entry_point` the program does not define takes it as the completion of the row's prompt
                 (HumanEval's form: prompt + completion)
    row       -> the tests: `tests` (or HumanEval's `test`: assert-style code) or `cases` (stdin/stdout)
    run       -> a bounded pool of `workers` sandboxes, each sample in its own (slot uid, scratch folder, limits)
    reward    -> 1.0 when every test passed (partial_credit: the fraction that passed); 0.0 for a response cut at
                 the length limit
Each sample's metadata says why (`extracted_answer` and `code_reason`: "passed", "failed assertion: ...", "syntax
error: ...", "timeout", "memory", "cpu time", "output too long", "ended before its tests did", "error: ..."), and the
step's counts go to the metrics as `code/<reason kind>` (code/passed, code/failed_assertion, code/timeout, ...).
A sandbox that cannot run at all (not a program's fault) scores the sample 0 and counts as a reward error.
"""

from __future__ import annotations

import queue
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional, Sequence

import torch

from mrl.config.errors import ConfigError
from mrl.environments.base import (
    EXTRACTED_ANSWER,
    FINISHED,
    REWARD_ERROR,
    ROW,
    EnvironmentStep,
    Message,
    last_response,
)
from mrl.environments.code.sandbox import (
    INSTALL_FIX,
    RunResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    check_available,
    warn_unsandboxed,
)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
#: The kinds a reason is counted under (its words before the first ':').
REASON_KINDS = (
    "passed",
    "failed assertion",
    "wrong output",
    "syntax error",
    "error",
    "timeout",
    "cpu time",
    "memory",
    "output too long",
    "ended before its tests did",
    "killed",
    "no tests ran",
    "truncated",
)


def extract_program(response: str) -> str:
    """The last fenced code block of the response, else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def program_for(response: str, row: Mapping[str, Any]) -> str:
    """The program to run: the response's code, after the row's prompt when it must complete it (see above)."""
    code = extract_program(response)
    entry = row.get("entry_point")
    if entry and not re.search(rf"^\s*def\s+{re.escape(str(entry))}\s*\(", code, re.MULTILINE):
        return str(row.get("prompt", "")) + code
    return code


def harness_spec(program: str, row: Mapping[str, Any], case_timeout_s: float) -> dict[str, Any]:
    """What the harness runs (harness.py): the program and the row's tests or cases."""
    spec: dict[str, Any] = {"program": program, "entry_point": row.get("entry_point")}
    if row.get("cases") is not None:
        spec |= {"cases": list(row["cases"]), "case_timeout_s": case_timeout_s}
    else:
        spec["tests"] = str(row.get("tests", row.get("test", "")))
    return spec


def reason_kind(reason: str) -> str:
    """A reason's kind, for counting: its words before the first ':' when they are one of REASON_KINDS."""
    head = reason.split(":", 1)[0].strip()
    return head if head in REASON_KINDS else ("killed" if head.startswith("killed") else "error")


class CodeEnvironment:
    """Single-turn: each sample's program run in a sandbox of a bounded pool (see the module docstring)."""

    def __init__(self, cfg: Any = None, *, key: str = "env.code") -> None:
        """From a `CodeEnvConfig` (None: its defaults). Refuses to start without the sandbox tool (the error says
        how to install it: a ConfigError naming `key`.sandbox, exit 2); `sandbox: none` runs with rlimits only and
        warns at every start."""
        from mrl.config.schema import CodeEnvConfig

        self.cfg = cfg or CodeEnvConfig()
        try:
            check_available(self.cfg.sandbox)
        except SandboxUnavailable as exc:
            raise ConfigError(
                f"the code environment's sandbox cannot run here: {exc}",
                key=f"{key}.sandbox",
                given=self.cfg.sandbox,
                fix=f"{INSTALL_FIX}; or {key}.sandbox=none to run programs WITHOUT isolation (only code you trust)",
            ) from None
        if self.cfg.sandbox == "none":
            warn_unsandboxed(f"{key}.sandbox")
        limits = SandboxLimits(
            self.cfg.wall_s, self.cfg.cpu_s, self.cfg.memory_mb, self.cfg.processes, self.cfg.open_files,
            self.cfg.output_kb, self.cfg.scratch_mb,
        )  # fmt: skip
        self.sandbox = Sandbox(self.cfg.sandbox, limits)
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(self.cfg.workers):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="mrl-code")

    def run(self, program: str, row: Mapping[str, Any]) -> RunResult:
        """One program with its row's tests, in a free slot of the pool's (blocks until one is free)."""
        slot = self._slots.get()
        try:
            return self.sandbox.run(harness_spec(program, row, self.cfg.case_timeout_s), slot=slot)
        finally:
            self._slots.put(slot)

    def score(self, result: RunResult) -> float:
        if result.limit is not None or not result.total:
            return 0.0
        if self.cfg.partial_credit:
            return result.passed / result.total
        return float(result.passed == result.total)

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        responses = [last_response(messages) for messages in message_logs]
        rows = [meta.get(ROW) or {} for meta in metadata]
        futures = [
            self._pool.submit(self._judge, response, row, bool(meta.get(FINISHED, True)))
            for response, row, meta in zip(responses, rows, metadata)
        ]
        judged = [future.result() for future in futures]
        new_meta, counts, errors = [], {f"code/{kind.replace(' ', '_')}": 0.0 for kind in REASON_KINDS}, []
        for meta, (_, reason, tests, error) in zip(metadata, judged):
            extra = {EXTRACTED_ANSWER: reason, "code_reason": reason, "code_tests": tests}
            if error is not None:
                extra[REWARD_ERROR] = error
                errors.append(error)
            new_meta.append(dict(meta, **extra))
            counts[f"code/{reason_kind(reason).replace(' ', '_')}"] += 1
        return EnvironmentStep(
            torch.tensor([reward for reward, *_ in judged], dtype=torch.float32),
            [{"role": "environment", "content": ""} for _ in judged],
            torch.ones(len(judged), dtype=torch.bool),
            new_meta,
            len(errors),
            errors[:4],
            {key: value for key, value in counts.items() if value},
        )

    def _judge(self, response: str, row: Mapping[str, Any], finished: bool) -> tuple[float, str, str, Optional[str]]:
        """(reward, reason, "passed/total", the sandbox's own failure or None) of one sample."""
        if not finished:
            return 0.0, "truncated", "0/0", None
        if not any(key in row for key in ("tests", "test", "cases")):
            return 0.0, "no tests ran", "0/0", "code environment: the row has no tests, test or cases"
        try:
            result = self.run(program_for(response, row), row)
        except Exception as exc:  # noqa: BLE001  the sandbox failing is no judgement of the program: counted
            return 0.0, "error: sandbox", "0/0", f"code sandbox: {type(exc).__name__}: {exc}"
        return self.score(result), result.reason, f"{result.passed}/{result.total}", None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
