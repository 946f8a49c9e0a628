#!/usr/bin/env bash
# Launch an mrl command on a Slurm allocation: one Ray head on the first node, one Ray worker per other node,
# all inside the same container image, then the mrl command on the head.
#
#   CONTAINER=registry/mrl:latest MOUNTS=/lustre:/lustre \
#   sbatch --nodes=2 --gpus-per-node=8 --time=04:00:00 slurm/ray-sbatch.sh \
#       mrl grpo --config recipes/grpo-deepscaler-1.5b-8K.yaml cluster.num_nodes=2 cluster.ray_address=auto
#
# Needs the pyxis/enroot `srun --container-image` plugin. Slurm sends SIGTERM before the time limit; mrl saves
# a checkpoint on SIGTERM, and re-submitting the same command resumes from it.
#SBATCH --job-name=mrl
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:TERM@300
set -euo pipefail
: "${CONTAINER:?set CONTAINER to the mrl image}"
MOUNTS=${MOUNTS:-$PWD:$PWD}
RAY_PORT=${RAY_PORT:-6379}
GPUS=${SLURM_GPUS_PER_NODE:-8}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
run_on() {  # node, command...
  local node=$1; shift
  srun --nodes=1 --ntasks=1 -w "$node" --container-image="$CONTAINER" --container-mounts="$MOUNTS" \
       --container-workdir="$PWD" bash -c "$*" &
}
run_on "$head" "ray start --head --node-ip-address=$head_ip --port=$RAY_PORT --num-gpus=$GPUS --block"
sleep 10
for node in "${nodes[@]:1}"; do
  run_on "$node" "ray start --address=$head_ip:$RAY_PORT --num-gpus=$GPUS --block"
done
sleep 10
srun --overlap --nodes=1 --ntasks=1 -w "$head" --container-image="$CONTAINER" --container-mounts="$MOUNTS" \
     --container-workdir="$PWD" env RAY_ADDRESS="$head_ip:$RAY_PORT" "$@" &
main=$!
trap 'kill -TERM $main; wait $main' TERM
wait $main
