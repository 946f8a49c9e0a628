"""Config errors a user can cause: one message with the dotted key, what was given, what is allowed, the fix."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

# Exit status of every command when the configuration is wrong (before anything starts).
CONFIG_ERROR_EXIT_CODE = 2


class ConfigError(ValueError):
    """A configuration problem found before any worker starts."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        given: Any = None,
        allowed: str | None = None,
        fix: str | None = None,
        problems: list["ConfigError"] | None = None,
    ):
        self.message, self.key, self.given, self.allowed, self.fix = message, key, given, allowed, fix
        self.problems = problems or []
        super().__init__(self.render())

    def render(self) -> str:
        if self.problems:
            lines = [f"{len(self.problems)} problem(s) in the configuration:"]
            lines += ["  - " + p.render().replace("\n", "\n    ") for p in self.problems]
            return "\n".join(lines)
        head = f"{self.key}: {self.message}" if self.key else self.message
        parts = [head]
        if self.given is not None:
            parts.append(f"given: {str(self.given).lower() if isinstance(self.given, bool) else repr(self.given)}")
        if self.allowed:
            parts.append(f"allowed: {self.allowed}")
        if self.fix:
            parts.append(f"fix: {self.fix}")
        return "\n    ".join(parts)


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt `name`, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None
