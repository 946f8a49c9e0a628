"""`kind: nemo_gym`: a NeMo Gym resource server whose episodes the agent loop plays in NeMo Gym's formats.

The server is started here from NeMo Gym's own Python (process.py) and stopped by `shutdown`, or it is one already
running at `url` (which must answer at the start). A server that dies later costs its episodes their reward (0,
counted as reward errors of this environment) and the run goes on. It is a `ServerEnvironment` (the run rolls it out
with mrl/algorithms/agent.py, in a mix with mrl/algorithms/mixed_rollouts.py) whose client speaks NeMo Gym's dialect
(client.py).
"""

from __future__ import annotations

from typing import Any

from mrl.environments.nemo_gym.client import NemoGymClient
from mrl.environments.server_env import ServerEnvironment


class NemoGymEnvironment(ServerEnvironment):
    client_class = NemoGymClient

    def __init__(self, cfg: Any, *, key: str = "env.nemo_gym") -> None:
        """From a `NemoGymEnvConfig`; `key` names it in errors (env.nemo_gym, envs.<name>.nemo_gym)."""
        self.cfg = cfg
        self._running = None
        self._process = None
        from mrl.environments.nemo_gym.process import GymServerProcess, require_alive

        if cfg.url:
            self.url = cfg.url.rstrip("/")
            require_alive(self.url, key)
            return

        self._process = GymServerProcess(
            cfg.server, cfg.name or cfg.server, dict(cfg.config), start_timeout_s=cfg.start_timeout_s, key=key
        )
        self.url = self._process.url

    def shutdown(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None
