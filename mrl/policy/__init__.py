"""The Megatron policy: interface.py (what the loops see), group.py (the controller's handle over one Ray actor per
rank), worker.py (one rank), train_step.py / logprobs.py (the math on a rank), export.py (HF tensors for refit and
export), optim.py (optimizer and LR schedule), memory.py (the memory hand-over to a colocated engine)."""
