#!/usr/bin/env bash
# Shared by train_test.sh and train_full.sh: plan, lock, log, launch. Not meant to be run directly.
#
# Launcher flags (everything else goes to `python -m diffsynth_mbc.train`):
#   --demo        tiny random TI2V-architecture model on a synthetic catalogue, 2 CPU processes
#                 (also chosen when there is no GPU and no --model_dir/MODEL_DIR)
#   --deepspeed   DeepSpeed ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml) instead of DDP
#   --multinode   several nodes: MASTER_ADDR, MASTER_PORT, NUM_MACHINES, MACHINE_RANK from the environment
#   --gpus N      processes per node (default: NUM_GPUS, else every GPU nvidia-smi lists)
#   --cached      encode every clip and caption once first (python -m diffsynth_mbc.cache; resumable,
#                 finished entries are skipped), then train the DiT from that latent cache
#   --detach      run in the background (log file only); prints the pid and returns
# Environment: PYTHON (default: python), MBC_LOG_FILE, NCCL_* (see configs/nccl_pcie.env).
set -euo pipefail

MBC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}

mbc_die() { echo "error: $*" >&2; exit 2; }

mbc_count_gpus() {
  if [[ -n "${NUM_GPUS:-}" ]]; then echo "$NUM_GPUS"; return; fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

mbc_free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# mbc_launch PRESET [launcher flags] [train flags]
mbc_launch() {
  local preset=$1; shift
  local demo=0 deepspeed=0 multinode=0 detach=0 cached=0 gpus="" train_args=()
  while (($#)); do
    case $1 in
      --demo) demo=1 ;;
      --deepspeed) deepspeed=1 ;;
      --multinode) multinode=1 ;;
      --detach) detach=1 ;;
      --cached) cached=1 ;;
      --gpus) [[ $# -ge 2 ]] || mbc_die "--gpus needs a number"; gpus=$2; shift ;;
      --gpus=*) gpus=${1#--gpus=} ;;
      *) train_args+=("$1") ;;
    esac
    shift
  done
  # Relative paths (presets, runs/) are taken from the folder the launcher is started in.
  [[ -f $preset ]] || preset=$MBC_ROOT/$preset

  local model_given=0
  for arg in "${train_args[@]+"${train_args[@]}"}"; do [[ $arg == --model_dir* || $arg == --model_id* ]] && model_given=1; done
  [[ -n "${MODEL_DIR:-}" ]] && { model_given=1; train_args+=(--model_dir "$MODEL_DIR"); }
  if [[ $demo == 0 && $model_given == 0 && $(mbc_count_gpus) == 0 ]]; then
    echo "no GPU and no --model_dir/MODEL_DIR: running the built-in demo (pass --demo to choose it explicitly)" >&2
    demo=1
  fi

  local accelerate_args=() env_prefix=()
  if [[ $demo == 1 ]]; then
    preset=$MBC_ROOT/configs/train_demo.yaml
    gpus=2
    env_prefix=(env ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1)
    accelerate_args=(--multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
                     --dynamo_backend no --main_process_port "$(mbc_free_port)")
  else
    # shellcheck disable=SC1091
    source "$MBC_ROOT/configs/nccl_pcie.env"
    [[ -n $gpus ]] || gpus=$(mbc_count_gpus)
    [[ $gpus =~ ^[1-9][0-9]*$ ]] || mbc_die "cannot tell how many GPUs to use (got '$gpus'); pass --gpus N"
    local config=$MBC_ROOT/configs/accelerate/ddp.yaml
    [[ $deepspeed == 1 ]] && config=$MBC_ROOT/configs/accelerate/deepspeed_zero2.yaml
    if [[ $multinode == 1 ]]; then
      [[ -n "${MASTER_ADDR:-}" && -n "${NUM_MACHINES:-}" && -n "${MACHINE_RANK:-}" ]] ||
        mbc_die "--multinode needs MASTER_ADDR, NUM_MACHINES and MACHINE_RANK in the environment"
      [[ $deepspeed == 1 ]] || config=$MBC_ROOT/configs/accelerate/multinode.yaml
      accelerate_args=(--config_file "$config" --num_machines "$NUM_MACHINES" --machine_rank "$MACHINE_RANK"
                       --main_process_ip "$MASTER_ADDR" --main_process_port "${MASTER_PORT:-29500}"
                       --num_processes $((gpus * NUM_MACHINES)))
    else
      accelerate_args=(--config_file "$config" --num_processes "$gpus" --main_process_port "${MASTER_PORT:-29500}")
    fi
  fi
  local world_size=$gpus
  [[ $multinode == 1 ]] && world_size=$((gpus * NUM_MACHINES))

  # Where this run writes; validates every flag without reading any data.
  local paths OUTPUT_PATH LOG_DIR
  paths=$("$PYTHON" -m diffsynth_mbc.plan --paths-only --world_size "$world_size" --config "$preset" \
          "${train_args[@]+"${train_args[@]}"}") || exit 2
  eval "$paths"
  mkdir -p "$OUTPUT_PATH" "$LOG_DIR"

  # One training per output folder. The lock is an open file descriptor that every process of the
  # run inherits, so it is held while any of them lives and released by the kernel when all exit:
  # a lock left by a crashed run is never mistaken for a live one.
  local lock_file=$OUTPUT_PATH/.train.lock pid_file=$OUTPUT_PATH/.train.pid
  exec 9>>"$lock_file"
  if ! flock -n 9; then
    echo "error: a training is already running on $OUTPUT_PATH (pid $(cat "$pid_file" 2>/dev/null || echo '?')); not starting another" >&2
    exit 75
  fi
  if [[ -s $pid_file ]]; then
    echo "note: cleared a stale lock of pid $(cat "$pid_file") (that run is no longer alive)" >&2
    rm -f "$pid_file"
  fi
  echo $$ > "$pid_file"

  [[ $demo == 1 ]] && "$PYTHON" -m diffsynth_mbc.demo prepare runs/demo

  # The plan: rows, GPUs, steps per GPU per epoch, total steps.
  "$PYTHON" -m diffsynth_mbc.plan --world_size "$world_size" --config "$preset" \
    "${train_args[@]+"${train_args[@]}"}" || exit 2

  export MBC_RUN_ID=${MBC_RUN_ID:-run-$(date +%Y%m%d-%H%M%S)}
  local log_file=${MBC_LOG_FILE:-$OUTPUT_PATH/train-$MBC_RUN_ID.log}

  if [[ $cached == 1 ]]; then
    if [[ $detach == 1 ]]; then mbc_die "--cached with --detach: build the cache first, then detach the training"; fi
    local CACHE_DIR VAL_CACHE_DIR CACHE_ARGS=() VAL_CACHE_ARGS=() cache_settings
    cache_settings=$("$PYTHON" -m diffsynth_mbc.plan --cache-commands --world_size "$world_size" --config "$preset" \
                     "${train_args[@]+"${train_args[@]}"}") || exit 2
    eval "$cache_settings"
    local cache_launch=("${env_prefix[@]+"${env_prefix[@]}"}" "$PYTHON" -m accelerate.commands.launch "${accelerate_args[@]}")
    echo "latent cache: $CACHE_DIR" | tee -a "$log_file" >&2
    "${cache_launch[@]}" -m diffsynth_mbc.cache "${CACHE_ARGS[@]}" 2>&1 | tee -i -a "$log_file"
    [[ ${PIPESTATUS[0]} == 0 ]] || { echo "error: building the latent cache failed (see $log_file)" >&2; exit 1; }
    train_args+=(--cache "$CACHE_DIR")
    if [[ -n $VAL_CACHE_DIR ]]; then
      "${cache_launch[@]}" -m diffsynth_mbc.cache "${VAL_CACHE_ARGS[@]}" 2>&1 | tee -i -a "$log_file"
      [[ ${PIPESTATUS[0]} == 0 ]] || { echo "error: building the validation cache failed (see $log_file)" >&2; exit 1; }
      train_args+=(--val_cache "$VAL_CACHE_DIR")
    fi
    if [[ $demo == 1 ]]; then   # a fresh rendezvous port for the training
      accelerate_args=("${accelerate_args[@]:0:${#accelerate_args[@]}-1}" "$(mbc_free_port)")
    fi
  fi
  local cmd=("${env_prefix[@]+"${env_prefix[@]}"}" "$PYTHON" -m accelerate.commands.launch "${accelerate_args[@]}"
             -m diffsynth_mbc.train --config "$preset" "${train_args[@]+"${train_args[@]}"}")
  echo "run $MBC_RUN_ID: ${cmd[*]}" | tee -a "$log_file" >&2
  echo "log: $log_file   per-GPU status: $LOG_DIR/training_gpu*.json   watch: python -m diffsynth_mbc.monitor $LOG_DIR" >&2

  if [[ $detach == 1 ]]; then
    setsid "${cmd[@]}" >>"$log_file" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$pid_file"
    echo "started in the background: pid $pid" >&2
    return 0
  fi
  set +e
  "${cmd[@]}" 2>&1 | tee -i -a "$log_file"
  local code=${PIPESTATUS[0]}
  set -e
  rm -f "$pid_file"
  return "$code"
}
