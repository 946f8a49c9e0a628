"""A NeMo Gym resource server as a process of NeMo Gym's own Python: started, health-checked, stopped.

    start   <gym python> launch.py <server> <name> <port> <config> <our pid>, in a scratch folder (importing nemo_gym
            writes caches under the current directory), its output to <scratch>/server.log, in a session of its own
    ready   GET / answers {"status": "ok"} within start_timeout_s; a process that exits first, or a timeout, is a
            ConfigError (exit 2: a re-run meets it again) naming the server, with the log's last lines and the fix
    stop    SIGTERM to its process group, SIGKILL after 5 s; the scratch folder removed

The server also ends on its own when this process does (launch.py watches its parent), so a controller killed with
SIGKILL leaves none behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mrl.config.errors import ConfigError
from mrl.data.nemo_gym import gym_python

LAUNCHER = Path(__file__).with_name("launch.py")
_LOG_TAIL = 20


class GymServerProcess:
    def __init__(self, server: str, name: str, config: dict, *, start_timeout_s: float, key: str) -> None:
        self.server, self.name, self.key = server, name, key
        self.python = gym_python(key)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scratch = Path(tempfile.mkdtemp(prefix=f"mrl-nemo-gym-{name}-"))
        self.log = self.scratch / "server.log"
        args = [str(LAUNCHER), server, name, str(self.port), json.dumps(config), str(os.getpid())]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [str(self.python), *args],
                cwd=self.scratch,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=_server_env(),
            )
        started = time.monotonic()
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop(keep_log=True)
            raise
        print(
            f"[mrl] NeMo Gym server {server} ({key.removesuffix('.nemo_gym')}) up at {self.url} in "
            f"{time.monotonic() - started:.1f} s (its log: {self.log})",
            file=sys.stderr,
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise self._failed(f"exited with status {self.process.returncode} before it answered")
                try:
                    if http.get(f"{self.url}/").json().get("status") == "ok":
                        return
                except (httpx.HTTPError, ValueError, AttributeError):
                    pass
                time.sleep(0.2)
        raise self._failed(f"did not answer GET {self.url}/ within {timeout_s:.0f} s")

    def _failed(self, why: str) -> ConfigError:
        tail = self.log.read_text(errors="replace").splitlines()[-_LOG_TAIL:] if self.log.is_file() else []
        return ConfigError(
            f"NeMo Gym's {self.server!r} server (as {self.name!r}) {why}; its log ({self.log}) ends:\n"
            + "\n".join(f"    | {line}" for line in tail),
            key=f"{self.key}.server",
            given=self.server,
            fix=f"what the log names: its config fields go in {self.key}.config; a server with dependencies of its "
            f"own needs them in {self.python.parent.parent} (resources_servers/{self.server}/requirements.txt)",
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, *, keep_log: bool = False) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()
        if not keep_log:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env() -> dict[str, str]:
    """Our environment without what would send the server to mrl's Python packages or Ray cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RAY_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def require_alive(url: str, key: str) -> None:
    """A server given by its url answers GET / with {"status": "ok"}, else the ConfigError that says so."""
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as http:
            answer = http.get(f"{url}/")
        if answer.is_success and answer.json().get("status") == "ok":
            return
        why = f"answered GET {url}/ with HTTP {answer.status_code}: {answer.text[:200]!r}"
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        why = f"does not answer GET {url}/ ({type(exc).__name__}: {exc})"
    raise ConfigError(
        f"the NeMo Gym server {why}",
        key=f"{key}.url",
        given=url,
        fix=f"start the server first (its liveness answer is {{'status': 'ok'}}), or drop {key}.url to have the run "
        "start it",
    )
