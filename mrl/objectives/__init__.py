"""The pure math of the objectives: policy losses (loss.py), group advantages and DAPO's reward shaping
(advantages.py), PPO's GAE, value loss and distillation's signal (ppo.py), run metrics (mismatch.py: engine vs
trainer logprobs; passk.py: pass@k). Tensors in, tensors or floats out: no I/O, no Ray, no process groups; every
other layer may use them."""
