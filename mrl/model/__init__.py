"""The Megatron-Core model of an HF config (build.py): the one builder the policy, the Megatron rollout engine and
`mrl convert` share. Names and layouts of the weights come from `converters/`."""
