"""Environments as HTTP resource servers (NeMo Gym's shape), for multi-turn agent loops.

A server (resource.py) holds per-session state and offers tools and a verifier over HTTP; the clients (client.py)
call it and turn every server failure into a result with `error` set; protocol.py is the wire format between them;
examples.py has GuessNumber and Calculator (`mrl env serve guess_number`).
"""

from mrl.environments.servers.client import AsyncResourceClient, ResourceClient, SessionHandle, ToolResult, VerifyResult
from mrl.environments.servers.examples import EXAMPLES, Calculator, GuessNumber
from mrl.environments.servers.protocol import ToolSpec
from mrl.environments.servers.resource import (
    InputError,
    ResourceServer,
    RunningServer,
    build_app,
    serve,
    tool,
    tool_specs,
)

__all__ = [
    "AsyncResourceClient",
    "Calculator",
    "EXAMPLES",
    "GuessNumber",
    "InputError",
    "ResourceClient",
    "ResourceServer",
    "RunningServer",
    "SessionHandle",
    "ToolResult",
    "ToolSpec",
    "VerifyResult",
    "build_app",
    "serve",
    "tool",
    "tool_specs",
]
