"""Mistakes in how a command names its config file, answered before argparse reads the command line (argparse would
say "unrecognized arguments: --config", "the following arguments are required: --config" or "cannot parse
override", or keep the last of two --config files silently):

    mrl grpo my.yaml                   the file where an override belongs: did you mean --config my.yaml?
    mrl grpo --config a.yaml b.yaml    a second config file: a command reads one (a recipe's defaults: combines them)
    mrl grpo --config a --config b     --config given twice
    mrl run --config my.yaml           `mrl run` and `mrl check` take the recipe as an argument, not with --config
"""

from __future__ import annotations

from typing import Collection, Optional

from mrl.config.errors import ConfigError
from mrl.config.recipes import shipped_recipes

#: The commands that take their recipe as an argument, with their usage.
RECIPE_ARGUMENT = {"run": "mrl run RECIPE [OVERRIDE ...]", "check": "mrl check RUN_DIR RECIPE [OVERRIDE ...]"}
COMBINE = "to build on another file, list it under `defaults:` in the one you keep (defaults: [base.yaml])"


def config_argument_mistake(argv: list[str], with_config: Collection[str]) -> Optional[ConfigError]:
    """The mistake in naming the config file (see the module docstring), or None; `with_config`: the commands that
    take `--config FILE`. What follows `--` is another command's (mrl submit) and is not read."""
    words = argv[: argv.index("--")] if "--" in argv else argv
    if not words:
        return None
    command = words[0]
    configs = [
        words[i + 1] if word == "--config" else word.partition("=")[2]
        for i, word in enumerate(words)
        if (word == "--config" and i + 1 < len(words)) or word.startswith("--config=")
    ]
    if configs and command in RECIPE_ARGUMENT:
        return ConfigError(
            f"`mrl {command}` takes the recipe as an argument, not with --config",
            key="--config",
            given=configs[0],
            fix=RECIPE_ARGUMENT[command].replace("RECIPE", configs[0]),
        )
    if len(configs) > 1:
        return ConfigError(
            f"given {len(configs)} times ({', '.join(configs)}): a command reads one config file",
            key="--config",
            fix=f"keep one --config; {COMBINE}",
        )
    files = _config_files(words)
    if command in RECIPE_ARGUMENT:
        configs, files = files[:1], files[1:]  # the recipe argument, then any file among the overrides
    elif command not in with_config:
        return None
    if not files:
        return None
    if not configs:
        return ConfigError(
            f"{files[0]!r} is a config file, not an override (key=value)",
            fix=f"did you mean --config {files[0]}? (mrl {'config show' if command == 'config' else command} "
            f"--config {files[0]} [OVERRIDE ...])",
        )
    return ConfigError(
        f"{files[0]!r} is a second config file, not an override (key=value); {configs[0]} is the first",
        fix=f"a command reads one config file: {COMBINE}",
    )


def _config_files(words: list[str]) -> list[str]:
    """The words that name a config file (a .yaml/.yml name, or a shipped recipe's) and are no option's value."""
    shipped = set(shipped_recipes())
    return [
        word
        for i, word in enumerate(words[1:], 1)
        if not word.startswith(("-", "~", "+"))
        and "=" not in word
        and (word.lower().endswith((".yaml", ".yml")) or word in shipped)
        and not (words[i - 1].startswith("-") and "=" not in words[i - 1])  # `--model-config x.yaml`: a flag's value
    ]
