"""The loops: grpo.py, sft.py, evaluate.py, score.py (and rollout.py, the samples -> training rows step), each
written against interfaces.py (`Workers`, `LoopCheckpoints`): no Ray, ranks, devices or checkpoint files here."""
