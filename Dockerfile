# GPU image for clusters (not built on the CPU development machines: they have no Docker engine).
# Megatron-Core + Transformer Engine + CUDA vLLM + Ray; mrl installed with its `gpu` extra.
FROM nvcr.io/nvidia/pytorch:25.09-py3
WORKDIR /opt/mrl
COPY pyproject.toml README.md ./
COPY mrl ./mrl
COPY converters ./converters
COPY recipes ./recipes
COPY slurm ./slurm
RUN pip install --no-cache-dir -e '.[gpu]'
ENV RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
ENTRYPOINT ["mrl"]
