"""Parallelism: the layout and its rules (layout.py, pure Python), process groups (groups.py), the pure-torch
attention for context parallelism and packing on CPU (attention.py), Megatron's CPU patches (cpu_compat.py)."""
