"""NeMo Gym's side of the data: where its install is, and its rows read as `Problem`s.

NeMo Gym (nemo-gym, pinned in requirements/gym.lock) needs Python >= 3.12 and ~160 packages of its own, so it lives
in a virtual environment apart from mrl's (`make gym-venv` builds `.venv-gym`); mrl never imports it. Its servers run
as processes of that environment (mrl/environments/nemo_gym); this module only finds the environment and reads rows.

    the Python          $MRL_GYM_PYTHON, else .venv-gym/bin/python in the current directory, else in mrl's checkout
    a server's rows     `nemo-gym:<server>/<file>` names a file a server ships in the wheel,
                        <site-packages>/resources_servers/<server>/data/<file> (e.g. its example.jsonl)

A NeMo Gym row is a JSON object with `responses_create_params` (an OpenAI Responses request: `input`, a string or a
list of messages {role, content}, and `tools`, function-tool schemas) and the fields its server's /verify reads
(`expected_answer`, `ground_truth`, ...). It becomes a `Problem` whose `problem` is the input's text (the messages'
contents, one after another: what a plain prompt shows), `answer` the row's expected answer when it has one
(display only: the server scores), and `fields` the whole row, which seeds the session and goes back to /verify.
A chat template renders the messages and tools themselves (`prompt_messages`, mrl/data/tasks.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from mrl.config.errors import ConfigError, suggest

ROW_KEY = "responses_create_params"
PATH_PREFIX = "nemo-gym:"
GYM_PYTHON_ENV = "MRL_GYM_PYTHON"
GYM_VENV = ".venv-gym"
INSTALL_FIX = "make gym-venv (builds .venv-gym with Python 3.12 and nemo-gym), or set MRL_GYM_PYTHON to its python"


def is_row(row: Any) -> bool:
    """A NeMo Gym row: an object with a Responses request."""
    return isinstance(row, dict) and isinstance(row.get(ROW_KEY), dict)


def gym_python(required_by: str = "envs.<name>.nemo_gym") -> Path:
    """The NeMo Gym environment's Python (see the module docstring), else the ConfigError that says how to build it."""
    given = os.environ.get(GYM_PYTHON_ENV)
    checkout = Path(__file__).resolve().parents[2]
    candidates = [Path(given)] if given else [root / GYM_VENV / "bin" / "python" for root in (Path.cwd(), checkout)]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ConfigError(
        f"NeMo Gym's Python is not installed (looked for {', '.join(str(p) for p in candidates)})",
        key=required_by,
        fix=INSTALL_FIX,
    )


def site_packages(python: Path) -> Path:
    """The site-packages folder of the environment `python` belongs to (lib/python3.X/site-packages)."""
    found = sorted((python.parent.parent / "lib").glob("python3.*/site-packages"))
    if not found:
        raise ConfigError(f"{python}: no lib/python3.*/site-packages beside it", key=GYM_PYTHON_ENV, fix=INSTALL_FIX)
    return found[-1]


def resolve_path(source: str, key: str) -> str:
    """`nemo-gym:<server>/<file>` as the file's path in the NeMo Gym install; any other source unchanged."""
    if not source.startswith(PATH_PREFIX):
        return source
    server, _, name = source[len(PATH_PREFIX) :].partition("/")
    servers = site_packages(gym_python(key)) / "resources_servers"
    if not (servers / server).is_dir():
        known = sorted(p.name for p in servers.iterdir() if (p / "app.py").is_file()) if servers.is_dir() else []
        near = suggest(server, known)
        raise ConfigError(
            f"NeMo Gym has no resource server {server!r}",
            key=key,
            given=source,
            allowed=f"{len(known)} servers: " + ", ".join(known[:30]) + (" ..." if len(known) > 30 else ""),
            fix=f"{PATH_PREFIX}{near}/{name}" if near else f"name one of its servers: {PATH_PREFIX}<server>/<file>",
        )
    path = servers / server / "data" / name
    if not path.is_file():
        shipped = sorted(p.name for p in (servers / server / "data").glob("*.jsonl"))
        raise ConfigError(
            f"NeMo Gym's {server} ships no data file {name!r}",
            key=key,
            given=source,
            allowed=", ".join(shipped) or "none",
            fix=f"name one of its files: nemo-gym:{server}/<file>, or a jsonl of your own rows",
        )
    return str(path)


def input_messages(row: dict) -> list[dict[str, str]]:
    """The request's input as chat messages [{role, content}] (a string input is one user message; content given as
    a list of parts keeps their text)."""
    given = row[ROW_KEY].get("input", [])
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages = []
    for item in given if isinstance(given, list) else []:
        if not isinstance(item, dict) or "content" not in item:
            continue
        role = item.get("role", "user")
        messages.append({"role": "system" if role == "developer" else str(role), "content": _text(item["content"])})
    return messages


def chat_tools(row: dict) -> Optional[list[dict]]:
    """The request's function tools in the form chat templates take ({"type": "function", "function": {...}}); None
    without tools."""
    tools = [
        {
            "type": "function",
            "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool},
        }
        for tool in row[ROW_KEY].get("tools") or []
        if isinstance(tool, dict) and tool.get("type", "function") == "function" and "name" in tool
    ]
    return tools or None


def prompt_and_answer(row: dict) -> Optional[tuple[str, str]]:
    """(the prompt text, the gold answer's text) of a NeMo Gym row; None when its input holds no text."""
    text = "\n\n".join(m["content"] for m in input_messages(row) if m["content"].strip())
    if not text.strip():
        return None
    answer = row.get("expected_answer", row.get("ground_truth", ""))
    return text.strip(), answer if isinstance(answer, str) else json.dumps(answer)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)
