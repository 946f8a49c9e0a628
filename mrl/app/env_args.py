"""`mrl env`'s arguments checked before a row is drawn, a file written or a socket bound: a count, a range or a port
that cannot be meant is answered with the flag and the fix, not a traceback, an empty file or another port.

Each check raises a `ConfigError` naming the flag, what was given, what is allowed and the fix (exit 2). --out is
checked here as mrl.app.preflight checks `mrl score --out`, without importing preflight's torch and engine modules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mrl.config.errors import ConfigError

#: The ports a TCP socket can bind (0: the system picks a free one).
MAX_PORT = 65535


def check_rows_arguments(args: argparse.Namespace) -> None:
    """`mrl env rows`: at least one row, a game of at least one guess over a range that holds a secret (the game's
    flags: guess_number only), and an --out that can be a file."""
    if args.count < 1:
        raise ConfigError(
            "the number of rows must be at least 1",
            key="--count",
            given=args.count,
            allowed="a whole number >= 1",
            fix="pass --count N with N >= 1 (default 2000)",
        )
    if args.name == "guess_number":
        if args.max_turns < 1:
            raise ConfigError(
                "a game needs at least one guess",
                key="--max-turns",
                given=args.max_turns,
                allowed="a whole number >= 1",
                fix="pass --max-turns N with N >= 1 (default 7)",
            )
        if args.low > args.high:
            raise ConfigError(
                "the secrets' range is empty: --low is above --high",
                key="--low",
                given=f"--low {args.low} --high {args.high}",
                allowed="--low at most --high (the smallest and largest secret, both included)",
                fix=f"swap them (--low {args.high} --high {args.low}) or pass another range",
            )
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(
            "it is a folder: name the jsonl file to write",
            key="--out",
            given=args.out,
            fix=f"name a file, e.g. --out {out / (args.name + '.jsonl')}",
        )
    blocked = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocked is not None:
        raise ConfigError(
            f"{blocked} is a file, so no folder can hold --out there",
            key="--out",
            given=args.out,
            fix="name a file in a folder (one that exists, or that mrl can make)",
        )


def check_port(port: int) -> None:
    """`mrl env serve --port`: a TCP port (the system would otherwise take it modulo 65536: another port)."""
    if not 0 <= port <= MAX_PORT:
        raise ConfigError(
            "not a TCP port",
            key="--port",
            given=port,
            allowed=f"0 to {MAX_PORT} (0 picks a free one)",
            fix="pass --port 8000 (the default), another port up to 65535, or --port 0",
        )
