"""The HTTP contract between a resource server (resource.py) and its client (client.py), shared by both.

    POST /seed_session      {"row": {...}}                 -> {"session_id": str, "observation": str | null}
    POST /<tool>            {<argument>: <value>, ...}     -> {"output": str | dict | null, "error": str | null,
                                                               "done": bool (the episode is over: no more turns)}
    POST /verify            {"row": {...}, "response": {}} -> {<row fields>, "reward": float, <components>,
                                                               "reward_components": [component names]}
    POST /aggregate_metrics {"results": [{...}, ...]}      -> {<metric>: float, ...}
    GET  /tools                                            -> {"server": str, "tools": [ToolSpec as a dict, ...]}
    GET  /health                                           -> {"status": "ok", "server": str, "sessions": int}

The session is named by the `X-Session-Id` header (what the client sends) or the `mrl_session` cookie that
/seed_session sets (for curl and browsers). Errors other than a tool's own come as {"detail": message} with a 4xx/5xx
status: 404 unknown session or tool, 422 bad arguments/row/response, 500 a bug in the server's code.
"""

from __future__ import annotations

from dataclasses import dataclass

SESSION_COOKIE = "mrl_session"
SESSION_HEADER = "X-Session-Id"
SEED_SESSION = "seed_session"
VERIFY = "verify"
AGGREGATE_METRICS = "aggregate_metrics"
TOOLS = "tools"
HEALTH = "health"
# Paths the framework owns: no tool may take these names, and the client never sends a tool call to them.
RESERVED_NAMES = frozenset({SEED_SESSION, VERIFY, AGGREGATE_METRICS, TOOLS, HEALTH, "docs", "redoc", "openapi.json"})
REWARD = "reward"
DONE = "done"
REWARD_COMPONENTS = "reward_components"


@dataclass(frozen=True)
class ToolSpec:
    """One tool as GET /tools lists it: enough to describe it in a prompt."""

    name: str
    parameters: tuple[str, ...]  # argument names, in the signature's order
    required: tuple[str, ...]  # those without a default
    description: str  # the tool's docstring ("" when it has none)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "parameters": list(self.parameters),
            "required": list(self.required),
            "description": self.description,
        }


def is_tool_name(name: str) -> bool:
    """A name that can be a tool: a Python identifier that is no framework endpoint."""
    return name.isidentifier() and name not in RESERVED_NAMES
