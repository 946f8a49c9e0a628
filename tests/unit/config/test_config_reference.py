"""The configuration reference page (mrl/config/reference.py, built into the docs by docs/hooks/config_reference.py)
lists every key of the schema with its default, type and bounds."""

from pathlib import Path

import yaml

from mrl.config import MrlConfig
from mrl.config.reference import config_reference_markdown, format_default

DEFAULTS_SNAPSHOT = Path(__file__).parent / "default_config.yaml"


def leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def rows(markdown: str) -> dict[str, list[str]]:
    """Table rows by key: `| `key` | type | default | allowed | description |`."""
    found = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            found[cells[0].strip("`")] = cells
    return found


def test_every_default_key_is_listed_with_its_default():
    table = rows(config_reference_markdown())
    defaults = dict(leaves(MrlConfig().model_dump(mode="json")))
    # the walk over the model's defaults covers exactly the keys of the reviewed snapshot (`mrl config show`)
    assert set(defaults) == {k for k, _ in leaves(yaml.safe_load(DEFAULTS_SNAPSHOT.read_text()))}
    missing = sorted(set(defaults) - set(table))
    assert not missing, f"keys missing from the reference: {missing}"
    for key, value in defaults.items():
        shown = table[key][2]
        assert shown == (f"`{format_default(value)}`" if format_default(value) else '`""`'), (key, shown, value)


def test_optional_and_list_sections_types_bounds_and_choices():
    markdown = config_reference_markdown()
    table = rows(markdown)
    for heading in ("## `policy`", "### `policy.parallel`", "### `policy.build`", "### `env.server`", "## `stages[]`"):
        assert f"\n{heading}\n" in markdown
    # keys of sections that are null by default, and of the list items, are listed too
    assert table["policy.build.family"][3] == "`llama` or `qwen2` or `qwen3` or `qwen3_moe`"
    assert table["env.reward_model.model"][2] == "*required*"
    assert table["stages[].algorithm"][3] == "`sft` or `dpo` or `rm` or `grpo` or `eval`"
    assert table["generation.top_p"][1:4] == ["float", "`1.0`", "&gt; 0, ≤ 1"]
    assert table["cluster.ray_address"][1] == "str or null"
    assert table["generation.stop_token_ids"][1:3] == ["list of int", "`[]`"]
    assert table["policy.optimizer.lr"][2] == "`1.0e-06`"
    assert table["grpo.max_off_policy_steps"][3] == "≥ 0, ≤ 1"
    assert "&lt;tool_call&gt;" in table["env.server.tool_format"][4]  # no raw HTML from descriptions
