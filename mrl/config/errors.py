"""Config errors a user can cause: one message with the dotted key, what was given, what is allowed, the fix."""

from __future__ import annotations

import difflib
from pathlib import Path
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


def not_utf8(path: str | Path, *, what: str, key: str | None = None, binary_fix: str) -> ConfigError:
    """The error for a file read as text whose bytes are not UTF-8. Bytes that read as text in another encoding
    (latin-1, Windows-1252: no NUL byte and hardly a control byte) get the line of the first byte UTF-8 does not allow
    and the re-encoding to do; a binary file under a text name gets `binary_fix`. `what`: what the file should have
    been ("a YAML config")."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    at: int | None = None
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        at = None if error.reason == "unexpected end of data" else error.start  # not a character the sample cut
    controls = sum(byte < 32 and byte not in b"\t\n\r\f" for byte in head)
    if b"\x00" in head or controls > len(head) // 100:
        return ConfigError(f"{path} is not UTF-8 text (a binary file?): not {what}", key=key, fix=binary_fix)
    line = "" if at is None else f" (line {head.count(10, 0, at) + 1}: byte 0x{head[at]:02x})"  # 10: a newline
    encoded = Path(path).with_name(f"{Path(path).stem}-utf8{Path(path).suffix}")
    return ConfigError(
        f"{path} is not UTF-8 text{line}: saved in latin-1 or another 8-bit encoding?",
        key=key,
        fix=f"re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > {encoded}, and use that file",
    )
