"""The learning checks (`make test-learning`): each test hands its figures to the `figure` fixture, and they are
printed together at the end of the run (mrl.testing.figures)."""

from mrl.testing.figures import figure, pytest_terminal_summary  # noqa: F401  (a fixture and a hook, for pytest)
