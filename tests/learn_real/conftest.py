"""The learning checks on the real SmolLM2-135M-Instruct (`make learn-real`, about an hour on 2 cores, outside CI's
budget): the real assets prepared once (mrl.testing.real_assets; the suite skips in one line without them), and the
figures printed together at the end of the run (mrl.testing.figures)."""

from mrl.testing.figures import figure, pytest_terminal_summary  # noqa: F401  (a fixture and a hook, for pytest)
from mrl.testing.real_assets import real_assets  # noqa: F401  (a fixture, for pytest)
