"""Runs untrusted programs (a policy's code) with their tests, so that no program can hurt the machine or the run.

    host                                                   sandbox (bubblewrap: every namespace unshared)
    setpriv --reuid <uid> (the slot's; never root)         /sandbox: a tmpfs of scratch_mb, the only writable path
      rlimits: CPU s, address space, processes of the uid,   (and the cwd), with harness.py bound read-only
      open files, file size (= the output cap)             /usr (+ the /bin, /lib, /lib64 links) read-only: the
    bwrap --unshare-all --die-with-parent --new-session      system Python and its standard library; /proc, /dev
      stdout, stderr -> files of a folder of ours (0700)     minimal; the root read-only; no /etc, /home, /root,
      an fd -> the results file                              the project, or network (its own loopback, down); a
                                                             pid namespace of its own
                                                           python3 -I harness.py: the program and its tests
                                                             (harness.py), results as JSON lines on that fd
    wall clock: past wall_s the process group is SIGKILLed; --die-with-parent and the pid namespace take every
    process of the program with it (a daemon it left, a fork bomb's children); then any process left under the
    slot's uid is killed

What a sample scored and why comes back as a `RunResult`: the per-test lines of the harness, or what ended the run
first (`timeout`, `cpu time`, `memory`, `output too long`, `ended before its tests did`, `killed`). Limits
(`SandboxLimits`) are per sample. The uid is the slot's own (a pool of N runs N slots; `slot_uid`: no other
process's slot shares it), so the process limit counts that sample's processes only. With `tool="none"` the program
runs with the same limits and uid in a scratch folder of the host, without namespaces (an explicit, warned setting:
it can read what any user can and reach the network).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

HARNESS = Path(__file__).with_name("harness.py")
#: The program's folder inside the sandbox (a tmpfs of its own; no path of the host).
BOX = "/sandbox"
#: Runs the sandbox's command as its child and reaps every process orphaned below it (a child subreaper), so that no
#: zombie is left to an init that does not reap (a container's): bwrap's own processes end as orphans.
REAPER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"  # PR_SET_CHILD_SUBREAPER
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "status = os.waitpid(child, 0)[1]\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "sys.exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))\n"
)
SYSTEM_PYTHON = "/usr/bin/python3"
FIRST_UID = 100_000
SLOTS = 128  # uids a process may use: FIRST_UID + (its pid % PROCESS_RANGES) * SLOTS + slot
PROCESS_RANGES = 20_000
INSTALL_FIX = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; make install does it as root)"


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # address space of each process
    processes: int = 32
    open_files: int = 64
    output_kb: int = 1024  # stdout, stderr and any file the program writes, each
    scratch_mb: int = 64  # the program's writable folder (bwrap: a tmpfs of that size, in memory)


@dataclass
class RunResult:
    tests: list[dict] = field(default_factory=list)  # the harness's lines: {"test", "passed", "reason"}
    limit: Optional[str] = None  # what ended the run before its verdict, if anything: a limit, or the program itself
    seconds: float = 0.0
    stderr: str = ""

    @property
    def passed(self) -> int:
        return sum(1 for t in self.tests if t.get("passed"))

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def reason(self) -> str:
        """Why it scored what it did: the limit, else the first failing test's reason, else "passed"."""
        if self.limit is not None:
            return self.limit
        failed = [t["reason"] for t in self.tests if not t.get("passed")]
        if failed:
            return failed[0]
        return "passed" if self.tests else "no tests ran"


def slot_uid(slot: int) -> int:
    """The uid slot `slot` of this process runs its samples as: its own, and another process's never (the uids of
    two processes on one machine differ unless their pids are equal modulo PROCESS_RANGES), so that killing what a
    sample left (every process of its uid) cannot touch another run's samples."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"sandbox slot {slot} out of 0..{SLOTS - 1}")
    return FIRST_UID + (os.getpid() % PROCESS_RANGES) * SLOTS + slot


class SandboxUnavailable(RuntimeError):
    """The sandbox tool is missing or does not work here; the message says how to install it."""


def check_available(tool: str) -> None:
    """Raise `SandboxUnavailable` unless `tool` can run a program here (bwrap: a trial run of the system Python)."""
    if not Path(SYSTEM_PYTHON).is_file():
        raise SandboxUnavailable(f"{SYSTEM_PYTHON} is missing: the sandbox runs programs with the system Python")
    if tool == "none":
        return
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_FIX}")
    trial = Sandbox(tool, SandboxLimits(wall_s=20))
    result = trial.run({"program": "print(1)", "tests": "assert True"}, slot=SLOTS - 1)
    if result.passed != 1:
        raise SandboxUnavailable(
            f"bwrap is installed but a trial run failed ({result.reason}; {result.stderr[-300:]}): user namespaces "
            "may be disabled (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)"
        )


class Sandbox:
    def __init__(self, tool: str = "bwrap", limits: SandboxLimits = SandboxLimits()) -> None:
        if tool not in ("bwrap", "none"):
            raise ValueError(f"sandbox tool {tool!r}: use 'bwrap' or 'none'")
        self.tool, self.limits = tool, limits

    def run(self, spec: dict[str, Any], *, slot: int = 0) -> RunResult:
        """Run `spec` (program, tests or cases, entry_point: see harness.py) in slot `slot`'s sandbox."""
        uid = slot_uid(slot)
        io = Path(tempfile.mkdtemp(prefix="mrl-code-io-"))  # ours (0700, root's): its output and results, as fds
        scratch = None
        if self.tool == "none":  # its cwd on the host (bwrap: a tmpfs of its own)
            scratch = Path(tempfile.mkdtemp(prefix="mrl-code-"))
            shutil.copy(HARNESS, scratch / "harness.py")
            os.chown(scratch, uid, uid)
        started = time.monotonic()
        try:
            limit = self._execute(scratch, io, uid, json.dumps(spec).encode())
            tests, done = _read_results(io / "results")
            stderr = (io / "stderr").read_bytes()[-2000:].decode(errors="replace")
            if limit is None and not done:
                limit = "memory" if "MemoryError" in stderr else "ended before its tests did"
            return RunResult(tests, limit, time.monotonic() - started, stderr)
        finally:
            _kill_uid(uid)
            shutil.rmtree(io, ignore_errors=True)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    def _command(self, uid: int) -> list[str]:
        python = [SYSTEM_PYTHON, "-I", "harness.py"]
        drop = [
            SYSTEM_PYTHON,
            "-I",
            "-c",
            REAPER,
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
        ]
        if self.tool == "none":
            return [*drop, *python]
        binds = ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path(f"/{link}").is_symlink():
                binds += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif Path(f"/{link}").is_dir():
                binds += ["--ro-bind", f"/{link}", f"/{link}"]
        scratch = ["--size", str(self.limits.scratch_mb * 1024 * 1024), "--tmpfs", BOX]
        return [
            *drop,
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            *binds,
            *("--proc", "/proc", "--dev", "/dev"),
            *scratch,
            *("--ro-bind", str(HARNESS), f"{BOX}/harness.py"),
            *("--remount-ro", "/"),  # the root (a tmpfs of bwrap's) read-only; BOX stays writable
            *("--chdir", BOX, "--clearenv"),
            *("--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", BOX, "--setenv", "TMPDIR", BOX),
            "--",
            *python,
        ]

    def _execute(self, scratch: Optional[Path], io: Path, uid: int, spec: bytes) -> Optional[str]:
        """Run the harness; the limit that ended it (None: it ended by itself)."""
        limits = self.limits
        with open(io / "stdout", "wb") as out, open(io / "stderr", "wb") as err, open(io / "results", "wb") as res:
            process = subprocess.Popen(
                self._command(uid),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=scratch,
                start_new_session=True,
                pass_fds=(res.fileno(),),
                preexec_fn=lambda: _child_setup(limits),
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            # A timer, not communicate(timeout=...): Popen's wait with a timeout polls with sleeps of up to 50 ms, which
            # cost more than the sample's own run; a blocking wait returns the moment the reaper ends.
            expired = threading.Event()

            def expire() -> None:
                expired.set()
                _stop(process, uid)

            timer = threading.Timer(limits.wall_s, expire)
            timer.start()
            try:
                assert process.stdin is not None
                process.stdin.write(_with_fd(spec, res.fileno()))
                process.stdin.close()
            except BrokenPipeError:
                pass  # it ended before reading: its status says how
            finally:
                process.wait()
                timer.cancel()
        return "timeout" if expired.is_set() else _limit_of(process.returncode)


def _limit_of(status: int) -> Optional[str]:
    """The limit a process's exit status tells of (a signal: its own, or bwrap's 128 + signal)."""
    if 0 <= status <= 128:
        return None
    number = -status if status < 0 else status - 128
    return {int(signal.SIGXCPU): "cpu time", int(signal.SIGKILL): "killed", int(signal.SIGXFSZ): "output too long"}.get(
        number, f"killed by signal {number}"
    )


def _with_fd(spec: bytes, fd: int) -> bytes:
    """The spec the harness reads, naming the descriptor it writes its results to."""
    return json.dumps({**json.loads(spec), "results_fd": fd}).encode()


def _child_setup(limits: SandboxLimits) -> None:
    """In the child before exec: the limits (inherited by everything it starts)."""
    memory = limits.memory_mb * 1024 * 1024
    output = limits.output_kb * 1024
    for which, value in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_NPROC, (limits.processes, limits.processes)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_FSIZE, (output, output)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)


def _stop(process: subprocess.Popen, uid: int) -> None:
    """Kill the sample's processes (its uid's), so that the reaper reaps them and ends; the reaper itself only if it
    does not (it would leave bwrap's processes as zombies to an init that may never reap them)."""
    _kill_uid(uid)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _kill_uid(uid: int) -> None:
    """Every process left under the slot's uid (a daemon the program started outside its namespaces: tool "none")."""
    for _ in range(3):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return
        time.sleep(0.01)


def _read_results(path: Path) -> tuple[list[dict], bool]:
    tests, done = [], False
    for line in path.read_bytes()[: 4 * 1024 * 1024].decode(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and item.get("done") is True:
            done = True
        elif isinstance(item, dict) and isinstance(item.get("passed"), bool):
            tests.append({"test": item.get("test"), "passed": item["passed"], "reason": str(item.get("reason"))[:400]})
    return tests, done


def warn_unsandboxed(where: str) -> None:
    print(
        f"[mrl] WARNING: {where}: code runs WITHOUT a sandbox (sandbox: none): a program can read and write what this "
        "user can and reach the network; only rlimits hold it",
        file=sys.stderr,
        flush=True,
    )
