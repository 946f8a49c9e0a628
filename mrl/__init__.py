"""mrl: RL post-training for LLMs on Megatron-Core, vLLM and Ray."""

__version__ = "0.1.0"
