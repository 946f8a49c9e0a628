#!/usr/bin/env bash
# Launch an mrl command on a Slurm allocation: a Ray head on the first node, one Ray worker per other node (each a
# `srun` step), a bounded wait until every node has joined, then the mrl command on the head, RAY_ADDRESS set.
#
#   sbatch --nodes=2 --gpus-per-node=8 --time=04:00:00 slurm/ray-sbatch.sh mrl grpo --config recipes/X.yaml ...
#   mrl submit --time=04:00:00 -- mrl grpo --config recipes/X.yaml ...   (checks the config first, then sbatch)
#
# Environment (all optional):
#   MRL_CONTAINER_IMAGE   run every step in this image (pyxis/enroot `srun --container-image`); unset: bare mode
#   MRL_CONTAINER_MOUNTS  container mounts, pyxis's SRC[:DST[:FLAGS]],... The submit folder is mounted at the same
#                         path in any case (every step runs in it: --container-workdir), added to these unless one
#                         of them already mounts it or a folder above it at the same path, writable
#   MRL_VENV              bare mode: virtual environment to activate (default: $SLURM_SUBMIT_DIR/.venv if present)
#   MRL_LOG_ROOT          logs go to $MRL_LOG_ROOT/<job id>[.<restart>]/ (default: $SLURM_SUBMIT_DIR/slurm-logs):
#                         driver.log (the mrl command), ray-<node>.log (each node's Ray)
#   MRL_RAY_PORT          Ray head port (default 6379); every other Ray port is fixed too, below the ephemeral range
#   MRL_JOIN_TIMEOUT_S    how long to wait for every node to join the Ray cluster (default 300)
#   MRL_REQUEUE=1         after a pre-emption (SIGTERM: the time limit via --signal, or scancel --signal=TERM) the
#                         mrl command saves and exits 0; this launcher then re-queues the job (same options, same
#                         command), which resumes from the newest checkpoint. At most MRL_MAX_REQUEUES (default 20).
#   MRL_DRY_RUN=1         print the commands instead of running them (how the container commands are tested)
#SBATCH --job-name=mrl
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:TERM@300
#SBATCH --open-mode=append
set -euo pipefail

submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
restart=${SLURM_RESTART_COUNT:-0}
log_dir=${MRL_LOG_ROOT:-$submit_dir/slurm-logs}/${SLURM_JOB_ID:?not inside a Slurm job}$([ "$restart" = 0 ] || echo ".$restart")
ray_port=${MRL_RAY_PORT:-6379}
# Fixed ports (Linux hands out ephemeral ports from 32768): several jobs on one node need distinct MRL_RAY_PORTs.
ports=(--node-manager-port=$((ray_port + 1)) --object-manager-port=$((ray_port + 2))
       --dashboard-agent-grpc-port=$((ray_port + 3)) --dashboard-agent-listen-port=$((ray_port + 4))
       --metrics-export-port=$((ray_port + 5)) --runtime-env-agent-port=$((ray_port + 6))
       --ray-client-server-port=$((ray_port + 7)) --min-worker-port=$((ray_port + 100))
       --max-worker-port=$((ray_port + 599)))
ray_ports="${ports[*]}"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
mkdir -p "$log_dir"
say() { echo "[mrl-launcher $(date +%T)] $*"; }
run() { if [ "${MRL_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }

with_submit_dir() {  # mounts, folder: the mounts, with the folder at the same path unless one of them holds it so
  local mounts=$1 dir=${2%/} mount src dst flags
  local -a entries
  IFS=',' read -ra entries <<< "$mounts"
  for mount in "${entries[@]}"; do
    IFS=':' read -r src dst flags <<< "$mount"
    dst=${dst:-$src}
    src=${src%/} dst=${dst%/}
    if [ "$src" = "$dst" ] && [[ "$dir" == "$src" || "$dir" == "$src"/* ]] && [[ "+$flags+" != *+ro+* ]]; then
      echo "$mounts"; return
    fi
  done
  echo "${mounts:+$mounts,}$dir:$dir"
}

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
if [ -n "${MRL_CONTAINER_IMAGE:-}" ]; then
  mounts=$(with_submit_dir "${MRL_CONTAINER_MOUNTS:-}" "$submit_dir")
  container=(--container-image="$MRL_CONTAINER_IMAGE" --container-mounts="$mounts" --container-workdir="$submit_dir")
  setup=":"
else
  container=()
  venv=${MRL_VENV:-$submit_dir/.venv}
  setup=$([ -f "$venv/bin/activate" ] && echo "source '$venv/bin/activate'" || echo ":")
  eval "$setup"
fi
on_head() {  # a command on the head node: a step in the image (container mode), else here (the batch script runs
            # on the first node of the allocation)
  if [ ${#container[@]} -gt 0 ]; then run srun --overlap --nodes=1 --ntasks=1 -w "$head_node" "${container[@]}" "$@"
  else run "$@"; fi
}
step() {  # node, log name, shell command: one srun step on that node, in the background
  run srun --overlap --nodes=1 --ntasks=1 -w "$1" "${container[@]}" --output="$log_dir/$2" \
      bash -c "$setup; $3; echo \"[mrl-launcher] stopped with status \$?\"" &
  steps+=($!)
}
steps=()

node_ip() {  # the IP Slurm reaches a node at (its NodeAddr: routable from the other nodes), else the head's own
  local addr
  addr=$(scontrol show node "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
  if [[ "$addr" =~ ^[0-9.]+$ ]]; then echo "$addr"; return; fi
  addr=$(getent ahostsv4 "${addr:-$1}" 2>/dev/null | awk '{print $1; exit}' || true)
  if [ -n "$addr" ] && [ "${addr#127.}" = "$addr" ]; then echo "$addr"; return; fi
  on_head hostname --ip-address | awk '{print $1}'
}
head_ip=$(node_ip "$head_node")
[ "${MRL_DRY_RUN:-0}" = 1 ] && head_ip=HEAD_IP
address="$head_ip:$ray_port"
say "job $SLURM_JOB_ID (restart $restart): ${#nodes[@]} node(s) ${nodes[*]}, Ray head $address, logs $log_dir"
if [ -n "${MRL_CONTAINER_IMAGE:-}" ]; then
  say "container $MRL_CONTAINER_IMAGE, mounts $mounts, working directory $submit_dir"
fi
gpus="--num-gpus=${SLURM_GPUS_PER_NODE:-0}"
step "$head_node" "ray-$head_node.log" "ray start --head --node-ip-address=$head_ip --port=$ray_port \
  --dashboard-port=$((ray_port + 8)) $ray_ports $gpus --block"
for node in "${nodes[@]:1}"; do
  step "$node" "ray-$node.log" "ray start --address=$address $ray_ports $gpus --block"
done
# Bounded wait: every node's Ray must be up; a node missing at the deadline is named and the job fails.
on_head python -m mrl.app.slurm wait-for-nodes --address "$address" --nodes "${nodes[@]}" \
    --timeout-s "${MRL_JOIN_TIMEOUT_S:-300}" --log-dir "$log_dir"

preempted=0
on_term() {
  preempted=1
  say "SIGTERM: passing it to the mrl command (it saves a checkpoint and exits)"
  kill -TERM "${driver:-}" 2>/dev/null || true
}
trap on_term TERM
say "running on $head_node: $*"
# Bare: the driver is the batch script's child and gets the TERM from the trap. Container: a step on the head; the
# trap's TERM reaches srun, which passes it on to the step.
driver_command=(env RAY_ADDRESS="$address" "$@")
if [ ${#container[@]} -gt 0 ]; then
  driver_command=(srun --overlap --nodes=1 --ntasks=1 -w "$head_node" "${container[@]}" "${driver_command[@]}")
fi
status=0
if [ "${MRL_DRY_RUN:-0}" = 1 ]; then
  echo "+ ${driver_command[*]}"
else
  "${driver_command[@]}" > "$log_dir/driver.log" 2>&1 &
  driver=$!
  wait "$driver" || status=$?
  while kill -0 "$driver" 2>/dev/null; do status=0; wait "$driver" || status=$?; done  # a trapped TERM ends `wait`
fi
say "the mrl command exited with status $status"
# Stop this job's Ray nodes (their steps; srun passes the TERM on). Not `ray stop`: it would stop every Ray of the
# user on the node, other jobs' included.
kill -TERM "${steps[@]}" 2>/dev/null || true
( sleep 10; kill -KILL "${steps[@]}" 2>/dev/null ) &
wait "${steps[@]}" 2>/dev/null || true
if [ "$preempted" = 1 ] && [ "$status" = 0 ] && [ "${MRL_REQUEUE:-0}" = 1 ]; then
  if [ "$restart" -ge "${MRL_MAX_REQUEUES:-20}" ]; then
    say "pre-empted, but the job was re-queued $restart times already (MRL_MAX_REQUEUES): not again"
  else
    say "pre-empted: re-queueing job $SLURM_JOB_ID; it resumes from the newest checkpoint"
    run scontrol requeue "$SLURM_JOB_ID"
  fi
fi
exit "$status"
