"""Parallelism: the layout and its rules (layout.py, pure Python), process groups (groups.py) and every collective
over them (collectives.py), the pure-torch attention for context parallelism and packing on CPU (attention.py),
Megatron's CPU patches (cpu_compat.py)."""
