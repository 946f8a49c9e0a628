"""Runs a program against its tests inside the sandbox (mrl/environments/code/sandbox.py), under the sandbox's own
Python: it imports nothing of mrl and only the standard library.

    python3 -I harness.py < spec (JSON on stdin: program, tests or cases, entry_point)

and writes one JSON line per test to the descriptor `results_fd` names (a file the host reads back), then
{"done": true}:

    tests (assert-style code)   the program is executed, then the tests' setup statements, then each assert alone:
                                the top-level asserts, and those in the body of a `check(candidate)` function
                                (HumanEval's form: `candidate` is the program's `entry_point`), one test each; a
                                check whose asserts sit in loops or branches is one test, `check(candidate)`
    cases (stdin/stdout)        the program runs as a process of its own per case, fed the case's input; it passes
                                when its output equals the expected output (trailing whitespace of lines ignored)

A test's line: {"test": i, "passed": bool, "reason": "passed" | "failed assertion: <message>" | "error: <Type>: <msg>"
| "syntax error: <msg>" | "timeout" | "memory"}. The program shares this process for assert-style tests (as every
in-process runner: HumanEval's own, Sandbox Fusion's), so a program written to forge the harness's output could;
stdin/stdout cases run apart and cannot.
"""

import ast
import json
import os
import subprocess
import sys


def main() -> None:
    spec = json.loads(sys.stdin.read())
    fd = int(spec["results_fd"])
    out = _Results(os.fdopen(os.dup(fd), "w", buffering=1))
    os.close(fd)
    sys.stdin.close()
    program = spec["program"]
    try:
        compile(program, "program.py", "exec")
    except SyntaxError as exc:
        out.write(json.dumps({"test": -1, "passed": False, "reason": f"syntax error: {exc.msg} (line {exc.lineno})"}))
        out.write("\n" + json.dumps({"done": True}) + "\n")
        return
    if spec.get("cases") is not None:
        _run_cases(program, spec["cases"], float(spec.get("case_timeout_s", 5.0)), out)
    else:
        _run_asserts(program, spec.get("tests") or "", spec.get("entry_point"), out)
    out.write(json.dumps({"done": True}) + "\n")
    out.flush()
    os._exit(0)  # the program's threads and atexit hooks do not get to run after the verdict


def _run_asserts(program: str, tests: str, entry_point, out) -> None:
    namespace: dict = {"__name__": "__main__"}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001  (whatever the program raises is its failure)
        _all_failed(tests, _reason(exc), out)
        return
    setup, asserts = _split(tests)
    if entry_point:
        namespace["candidate"] = namespace.get(entry_point)  # what a check(candidate) body names
    try:
        exec(compile(ast.Module(body=setup, type_ignores=[]), "tests.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001
        _all_failed(tests, _reason(exc), out)
        return
    for i, node in enumerate(asserts):
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "tests.py", "exec"), namespace)
            out.write(json.dumps({"test": i, "passed": True, "reason": "passed"}) + "\n")
        except BaseException as exc:  # noqa: BLE001
            out.write(json.dumps({"test": i, "passed": False, "reason": _reason(exc)}) + "\n")


class _Results:
    """The results stream, written by this process only: a process the program forked that returns into the harness
    (os.fork() in a loop) ends instead of reporting."""

    def __init__(self, stream) -> None:
        self.stream, self.pid = stream, os.getpid()

    def write(self, text: str) -> None:
        if os.getpid() != self.pid:
            os._exit(1)
        self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _split(tests: str):
    """(setup statements, assert statements): top-level asserts, and a `check` function's asserts (unrolled)."""
    tree = ast.parse(tests)
    setup: list = []
    asserts: list = []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            asserts.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name == "check" and _nested_asserts(node):
            setup.append(node)  # asserts inside loops or branches: the whole check is one test
            asserts.append(ast.parse("check(candidate)").body[0])
        elif isinstance(node, ast.FunctionDef) and node.name == "check":
            body = [n for n in node.body if not isinstance(n, ast.Assert)]
            setup += [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
            asserts += [n for n in node.body if isinstance(n, ast.Assert)]
        else:
            setup.append(node)
    return setup, asserts


def _nested_asserts(function) -> bool:
    top = sum(isinstance(n, ast.Assert) for n in function.body)
    return sum(isinstance(n, ast.Assert) for n in ast.walk(function)) > top


def _all_failed(tests: str, reason: str, out) -> None:
    try:
        count = max(len(_split(tests)[1]), 1)
    except SyntaxError:
        count = 1
    for i in range(count):
        out.write(json.dumps({"test": i, "passed": False, "reason": reason}) + "\n")


def _run_cases(program: str, cases, timeout_s: float, out) -> None:
    with open("program.py", "w") as f:
        f.write(program)
    for i, case in enumerate(cases):
        try:
            done = subprocess.run(
                [sys.executable, "-I", "program.py"],
                input=str(case["input"]).encode(),
                capture_output=True,
                timeout=timeout_s,
                close_fds=True,
            )
        except subprocess.TimeoutExpired:
            out.write(json.dumps({"test": i, "passed": False, "reason": "timeout"}) + "\n")
            continue
        got, want = _lines(done.stdout.decode(errors="replace")), _lines(str(case["output"]))
        if done.returncode != 0:
            last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            reason = "memory" if "MemoryError" in last[0] else f"error: {last[0][:300]}"
            reason = "output too long" if "File too large" in last[0] else reason
        else:
            reason = "passed" if got == want else f"wrong output: {json.dumps(got[:5])[:200]}"
        out.write(json.dumps({"test": i, "passed": reason == "passed", "reason": reason}) + "\n")


def _lines(text: str):
    return [line.rstrip() for line in text.strip().splitlines()]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, AssertionError):
        return f"failed assertion: {str(exc)[:300]}" if str(exc) else "failed assertion"
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: past the output limit (Python ignores SIGXFSZ)
        return "output too long"
    return f"error: {type(exc).__name__}: {str(exc)[:300]}"


if __name__ == "__main__":
    main()
