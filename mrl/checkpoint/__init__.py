"""Checkpoints: step folders written atomically with retention and train state on the controller (manager.py), the
reshardable Megatron model/optimizer/RNG state on every rank (megatron.py)."""
