"""`env.kind: server`: a resource server whose episodes the agent loop plays (mrl/algorithms/agent.py).

This object only owns the server's address and, for mrl's example servers, the server itself (started on loopback
for the run, stopped by `shutdown`). It scores nothing by `step`: multi-turn rewards come from the server's
`/verify` at the end of each episode.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from mrl.environments.base import EnvironmentStep, Message
from mrl.environments.servers.client import AsyncResourceClient


class ServerEnvironment:
    client_class: type[AsyncResourceClient] = AsyncResourceClient  # the protocol's dialect its episodes speak

    def __init__(self, cfg: Any) -> None:
        """From a `ServerEnvConfig`: an example server started here, or the `url` of a running one."""
        self.cfg = cfg
        self._running = None
        if cfg.example is not None:
            from mrl.environments.servers import EXAMPLES, serve

            self._running = serve(EXAMPLES[cfg.example]())
            self.url = self._running.url
        elif cfg.url:
            self.url = cfg.url.rstrip("/")
        else:
            raise ValueError(
                "env.kind=server needs env.server.example (one of mrl's example servers) or "
                "env.server.url (a running resource server)"
            )
        if cfg.tool_format == "bare" and not (cfg.tool and cfg.argument):
            raise ValueError(
                "env.server.tool_format=bare needs env.server.tool and env.server.argument (the one "
                "tool every turn calls, and the argument the turn's text fills)"
            )

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        raise TypeError(
            "a resource-server environment is played in multi-turn episodes by the agent loop "
            "(mrl.algorithms.agent), not scored one response at a time"
        )

    def shutdown(self) -> None:
        if self._running is not None:
            self._running.stop()
            self._running = None
