"""The application layer: what parses a command, starts Ray and the workers, and wires checkpoints around a loop.

commands.py (grpo | sft | eval | score runners), stages.py (`mrl run`), runtime.py (Ray, the policy group, the
engine, refit transport), starting_model.py (the model a run starts from, a built one or a folder, and its
tokenizer), model_source.py (an HF or a Megatron checkpoint folder to start from), checkpointing.py
(saving/resuming a loop, SIGTERM), convert.py (`mrl convert`), errors.py (what a command ends with), results.py
(where a run leaves its results, and the lines naming them), preflight.py (what a command reads, checked before any
worker starts). The command line itself is mrl/cli.py.
"""
