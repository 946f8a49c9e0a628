"""Data: problem/answer datasets (datasets.py), prompts and templates (templates.py, tasks.py), SFT batches (sft.py),
the arith task (arith.py), token-budget micro-batch plans (packing.py), the resumable loader (dataloader.py) and
the locally trained tokenizer of built models (tokenizers.py)."""
