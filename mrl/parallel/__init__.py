"""Parallelism: the layout and its rules (layout.py, pure Python), process groups (groups.py) and every collective
over them (collectives.py), the pure-torch attention for context parallelism and packing without Transformer Engine
(attention.py). What makes Megatron run on CPU lives in mrl.cpu."""
