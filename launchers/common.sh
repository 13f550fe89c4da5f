#!/usr/bin/env bash
# Shared by train_test.sh and train_full.sh: plan, lock, log, launch. Not meant to be run directly.
#
# Launcher flags (everything else goes to `python -m diffsynth_mbc.train`; every flag, launcher or training,
# is shown with underscores and works with dashes too: --learning_rate or --learning-rate):
#   --demo        tiny random TI2V-architecture model on a synthetic catalogue it writes under runs/demo,
#                 2 CPU processes (also chosen when there is no GPU and no --model_dir/MODEL_DIR); with
#                 --dataset_metadata_path (and --dataset_base_path) or --datasets it trains on that catalogue
#                 instead and writes none
#   --deepspeed   DeepSpeed ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml) instead of DDP
#   --multinode   several nodes: MASTER_ADDR, MASTER_PORT, NUM_MACHINES, MACHINE_RANK from the environment
#   --gpus N      processes per node (default: NUM_GPUS, else every GPU nvidia-smi lists; the demo: 2 CPU processes)
#   --cached      encode every clip and caption once first (python -m diffsynth_mbc.cache; resumable,
#                 finished entries are skipped), then train the DiT from that latent cache
#   --detach      run in the background (log file only); prints the pid and returns
#   --dry_run     validate every flag, check every path the run reads (relative ones are taken from the
#                 current folder, the presets' too), print the command and the step plan, start nothing
#   --skip_doctor launch even when the quick preflight checks (python -m diffsynth_mbc.doctor --quick) fail
#   --help        this text, then the training's own flags
# Before the training's own output a launch prints only the step plan's totals, the preflight summary, the run
# id, its log and the watch command; the paths read, the full plan, every preflight check and the accelerate
# command go to the run's log (OUTPUT_PATH/train-RUN_ID.log).
# Stop a run: bash launchers/stop.sh OUTPUT_PATH [--grace S]   (checkpoint, `stopped`; SIGKILL after S s)
# Environment: PYTHON (default: the active venv's python, else the project's .venv, else python3; checked first),
#   MBC_LOG_FILE, MBC_RUN_ID, NCCL_* (see configs/nccl_pcie.env).
set -euo pipefail
# SLURM's warning before a job's end (launchers/train.sbatch) reaches every process of the job: this shell and what it
# starts go on (the training's ranks take it: diffsynth_mbc.lifecycle.signals).
trap '' USR1

MBC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Known third-party deprecation notices, printed by every process of every run (torch's pynvml and
# torch.jit.script FutureWarnings); only these, by category and module. Anything already set wins.
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning:torch.cuda,ignore::FutureWarning:torch.jit._script}

mbc_die() { echo "error: $*" >&2; exit 2; }

# stop.sh beside the launcher as it was typed (MBC_LAUNCHER, set by train_test.sh and train_full.sh; a relative
# path is taken from the folder the launch was started in): the commands a launch prints work where it was started.
mbc_stop_command() { printf 'bash %q\n' "$(dirname "$MBC_LAUNCHER")/stop.sh"; }

# The launcher's own flags, as mbc_canonical spells them: anything else must be a training flag.
MBC_LAUNCHER_FLAGS=(--demo --deepspeed --multinode --gpus --cached --detach --dry_run --skip_doctor --help)

# mbc_canonical ARG: a flag as --help spells it, with underscores (--dry-run: --dry_run; --gpus=2 as it is);
# anything that is not a long flag as it is.
mbc_canonical() {
  local arg=$1 name value=""
  [[ $arg == --?* ]] || { printf '%s\n' "$arg"; return; }
  name=${arg%%=*}
  [[ $arg == *=* ]] && value="=${arg#*=}"
  name=${name#--}
  printf -- '--%s%s\n' "${name//-/_}" "$value"
}
# mbc_find_python: the Python every step runs, found before anything is locked or written: $PYTHON when set,
# else the active venv's, else the project's .venv (used without activating it), else python3 from PATH. Each
# is asked only whether the project's packages are installed (nothing is imported); when none has them, one
# line says how to create or activate the venv.
mbc_find_python() {
  local candidates=() candidate missing tried=()
  if [[ -n ${PYTHON:-} ]]; then
    candidates=("$PYTHON")
  else
    [[ -n ${VIRTUAL_ENV:-} ]] && candidates+=("$VIRTUAL_ENV/bin/python")
    candidates+=("$MBC_ROOT/.venv/bin/python" python3 python)
  fi
  for candidate in "${candidates[@]}"; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if missing=$("$candidate" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
                 diffsynth_mbc rich torch accelerate yaml 2>/dev/null) && [[ -z $missing ]]; then
      PYTHON=$candidate
      # The ranks and tools started from here find the same environment.
      [[ $candidate == */bin/python ]] && PATH=${candidate%/python}:$PATH
      return 0
    fi
    tried+=("$candidate lacks ${missing:-its packages}")
  done
  local venv=$MBC_ROOT/.venv
  if [[ -n ${PYTHON:-} ]]; then
    mbc_die "PYTHON=$PYTHON cannot run this project (${tried[0]:-not found}): point PYTHON at the project's venv" \
            "($venv/bin/python) or leave it unset"
  fi
  local found
  found=$(IFS=';'; echo "${tried[*]+"${tried[*]}"}")
  mbc_die "no Python here has the project's packages (${found:-no python3 on PATH}): activate its venv" \
          "(source $venv/bin/activate), or create it: bash $MBC_ROOT/install.sh"
}
mbc_find_python

mbc_usage() {
  echo "usage: bash $1 [launcher flags] [training flags]"
  echo
  sed -n '4,/^set -euo pipefail/p' "$MBC_ROOT/launchers/common.sh" | grep '^#' | sed 's/^# \{0,1\}//'
  echo
  echo "Training flags (python -m diffsynth_mbc.train):"
  "$PYTHON" -m diffsynth_mbc.train --help
}

# A run id nobody else has: two launches in the same second differ by the random suffix.
mbc_new_run_id() {
  echo "run-$(date +%Y%m%d-%H%M%S)-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
}

# mbc_lock FD FOLDER WHAT: one training per folder (per node of a run). The lock is taken exclusively
# (no process of another run holds it, not even a rank whose launcher died), then turned into a shared
# lock that every rank of this run takes too (diffsynth_mbc.lifecycle.run_lock): the folder stays locked
# while any process of the run lives, and the kernel releases it when all have exited.
mbc_lock() {
  local fd=$1 folder=$2 what=$3 lock pid_file
  lock=$folder/$(mbc_lock_name)
  pid_file=${lock%.lock}.pid
  if [[ -L $lock || ( -e $lock && ! -f $lock ) ]]; then
    mbc_die "$lock is not a regular file (a symbolic link or a device): remove it, then launch again"
  fi
  eval "exec $fd>>\"\$lock\""
  if ! flock -n -x "$fd"; then
    echo "error: a training is already running on $folder (its $what): run $(sed -n 2p "$pid_file" 2>/dev/null || echo '?')," \
         "$("$PYTHON" -c 'import sys; from diffsynth_mbc.lifecycle.stop_command import describe_holders as d; print(d(sys.argv[1]))' "$folder")." \
         "Not starting another; stop it with: $(mbc_stop_command) $(printf '%q' "$folder")" >&2
    exit 75
  fi
  if [[ -s $pid_file ]]; then
    echo "note: cleared a stale lock of pid $(head -n 1 "$pid_file") (that run is no longer alive)" >&2
    rm -f "$pid_file"
  fi
  printf '%s\n%s\n' "$$" "$MBC_RUN_ID" > "$pid_file"
  if ! flock -n -s "$fd"; then   # another launch took it between the two: it runs, this one does not
    echo "error: another training started on $folder (its $what) at the same moment; not starting this one" >&2
    exit 75
  fi
  MBC_LOCK_FILES+=("$lock")
}

# mbc_forget_records: the .train*.pid files of the locked folders that still name this launcher.
mbc_forget_records() {
  local lock pid_file
  for lock in "${MBC_LOCK_FILES[@]+"${MBC_LOCK_FILES[@]}"}"; do
    pid_file=${lock%.lock}.pid
    [[ $(head -n 1 "$pid_file" 2>/dev/null) == "$$" ]] && rm -f "$pid_file"
  done
  return 0
}

mbc_wait_for_file() {
  local file=$1 timeout=$2 what=$3 waited=0
  until [[ -s $file ]]; do
    ((waited < timeout)) || mbc_die "waited ${timeout}s for $what ($file)"
    sleep 1; waited=$((waited + 1))
  done
}

# After the cache job, the training needs a rendezvous port of its own: a fresh one on a single
# node; the next one after MASTER_PORT on several (every node must pick the same).
mbc_next_rendezvous_port() {
  local -n args=$1
  local demo=$2 multinode=$3 i
  for i in "${!args[@]}"; do
    [[ ${args[$i]} == --main_process_port ]] || continue
    if [[ $multinode == 1 ]]; then args[i + 1]=$((${MASTER_PORT:-29500} + 1))
    elif [[ $demo == 1 ]]; then args[i + 1]=$(mbc_free_port)
    fi
  done
}

mbc_lock_name() {
  local node=${MACHINE_RANK:-0}
  [[ ${MBC_MULTINODE:-0} == 1 && $node != 0 ]] && echo ".train.node$node.lock" || echo ".train.lock"
}

mbc_count_gpus() {
  if [[ -n "${NUM_GPUS:-}" ]]; then echo "$NUM_GPUS"; return; fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

mbc_port_free() {   # mbc_port_free PORT: nothing listens on PORT on this machine
  "$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the rendezvous store binds: TIME_WAIT is not "in use"
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(1)' "$1"
}

mbc_free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# mbc_dry_run_plan PRESET DEMO_DATA GPUS NODES CACHED [train flags]: the step plan a launch would print. The demo's
# catalogue (DEMO_DATA: where a launch writes it, or empty) is not written by a dry run: its plan counts a copy made
# in a temporary folder, removed after.
mbc_dry_run_plan() {
  local preset=$1 demo_data=$2 gpus=$3 nodes=$4 cached=$5 data=() scratch="" code=0
  shift 5
  if [[ -n $demo_data ]]; then
    scratch=$(mktemp -d)
    "$PYTHON" -m diffsynth_mbc.demo prepare "$scratch" > /dev/null 2>&1 ||
      { rm -rf "$scratch"; mbc_die "could not make the demo catalogue to plan with"; }
    data=(--dataset_base_path "$scratch/catalog" --dataset_metadata_path "$scratch/metadata/metadata.csv")
  fi
  local args=(--brief --gpus "$gpus" --nodes "$nodes")
  [[ $cached == 1 ]] && args+=(--cached)
  "$PYTHON" -m diffsynth_mbc.plan "${args[@]}" --config "$preset" "$@" "${data[@]+"${data[@]}"}" || code=2
  [[ -z $scratch ]] || rm -rf "$scratch"
  return $code
}

# mbc_launch PRESET [launcher flags] [train flags]
mbc_launch() {
  local preset=$1; shift
  # The command that resumes this run, shown when it is stopped: these flags without --resume/--detach.
  local resume_command="bash $(printf '%q' "$MBC_LAUNCHER")" arg drop=0
  for arg in "$@"; do
    if ((drop)); then drop=0; continue; fi
    case $(mbc_canonical "$arg") in --resume) drop=1; continue ;; --resume=*|--detach|--dry_run) continue ;; esac
    resume_command+=" $(printf '%q' "$arg")"
  done
  resume_command+=" --resume latest"
  local demo=0 deepspeed=0 multinode=0 detach=0 cached=0 dry_run=0 skip_doctor=0 gpus="" train_args=()
  while (($#)); do
    case $(mbc_canonical "$1") in
      --demo) demo=1 ;;
      --deepspeed) deepspeed=1 ;;
      --multinode) multinode=1 ;;
      --detach) detach=1 ;;
      --cached) cached=1 ;;
      --dry_run) dry_run=1 ;;
      --skip_doctor) skip_doctor=1 ;;
      --gpus) [[ $# -ge 2 ]] || mbc_die "--gpus needs a number"; gpus=$2; shift ;;
      --gpus=*) gpus=${1#--gpus=} ;;
      -h|--help) mbc_usage "$(printf '%q' "$MBC_LAUNCHER")"; exit 0 ;;
      *) train_args+=("$1") ;;
    esac
    shift
  done
  # A flag neither the launcher nor the training knows: one line with the closest real ones, before anything starts.
  "$PYTHON" -c 'import sys; from diffsynth_mbc.training.options.parser import check_launcher_args as c; sys.exit(c(sys.argv[1:]))' \
    "$(printf '%q' "$MBC_LAUNCHER")" "${MBC_LAUNCHER_FLAGS[@]}" -- "${train_args[@]+"${train_args[@]}"}" || exit 2
  # Relative paths (in the presets too: data/..., models/..., runs/...) are taken from the folder the launcher is
  # started in, as every flag's; the launch lists what each resolved to and refuses a missing one.
  [[ -f $preset ]] || preset=$MBC_ROOT/$preset

  local model_given=0
  for arg in "${train_args[@]+"${train_args[@]}"}"; do arg=$(mbc_canonical "$arg"); [[ $arg == --model_dir* || $arg == --model_id* ]] && model_given=1; done
  if [[ -n "${MODEL_DIR:-}" && $demo == 1 ]]; then   # the environment's, not a flag the user typed: say which
    mbc_die "--demo builds a tiny random model, but MODEL_DIR is set in the environment ($MODEL_DIR): unset it for" \
            "the demo (env -u MODEL_DIR bash $MBC_LAUNCHER --demo), or leave out --demo to train that model"
  fi
  [[ -n "${MODEL_DIR:-}" ]] && { model_given=1; train_args+=(--model_dir "$MODEL_DIR"); }
  if [[ $demo == 0 && $model_given == 0 && $(mbc_count_gpus) == 0 ]]; then
    echo "no GPU and no --model_dir/MODEL_DIR: running the built-in demo (--demo)" >&2
    demo=1
  fi
  # The demo trains on its own catalogue, written under runs/demo, unless it is given another one (its metadata, or a
  # datasets list): then it writes none. A base folder alone would pair the demo's metadata with other files.
  local demo_data="" data_flags=" "
  for arg in "${train_args[@]+"${train_args[@]}"}"; do arg=$(mbc_canonical "$arg"); data_flags+="${arg%%=*} "; done
  if [[ $demo == 1 && $data_flags != *" --dataset_metadata_path "* && $data_flags != *" --datasets "* ]]; then
    [[ $data_flags != *" --dataset_base_path "* ]] ||
      mbc_die "--demo with --dataset_base_path but no --dataset_metadata_path: the demo's own metadata lists the" \
              "files of the catalogue it writes under runs/demo; give --dataset_metadata_path too to train the demo" \
              "model on your catalogue, or leave out --dataset_base_path"
    demo_data=runs/demo
  fi

  local accelerate_args=() env_prefix=()
  if [[ $multinode == 1 ]]; then
    [[ -n "${MASTER_ADDR:-}" && -n "${NUM_MACHINES:-}" && -n "${MACHINE_RANK:-}" ]] ||
      mbc_die "--multinode needs MASTER_ADDR, NUM_MACHINES and MACHINE_RANK in the environment"
    [[ $NUM_MACHINES =~ ^[1-9][0-9]*$ && $MACHINE_RANK =~ ^[0-9]+$ && $MACHINE_RANK -lt $NUM_MACHINES ]] ||
      mbc_die "NUM_MACHINES must be a positive number and MACHINE_RANK one of 0..NUM_MACHINES-1"
    # Node 0 serves the rendezvous on MASTER_PORT: taken by another program, every node would wait silently.
    if [[ $MACHINE_RANK == 0 ]] && ! mbc_port_free "${MASTER_PORT:-29500}"; then
      mbc_die "MASTER_PORT ${MASTER_PORT:-29500} is already in use on this machine (node 0 serves the rendezvous" \
              "there): start every node with another MASTER_PORT"
    fi
  fi
  if [[ $demo == 1 ]]; then
    preset=$MBC_ROOT/configs/train_demo.yaml
    env_prefix=(env ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu)
    if [[ $multinode == 1 ]]; then   # each node one CPU process (gloo): a real several-node run on one machine
      gpus=${gpus:-1}
      accelerate_args=(--multi_gpu --num_processes $((gpus * NUM_MACHINES)) --num_machines "$NUM_MACHINES"
                       --machine_rank "$MACHINE_RANK" --main_process_ip "$MASTER_ADDR"
                       --main_process_port "${MASTER_PORT:-29500}" --mixed_precision no --dynamo_backend no)
    else   # CPU processes standing in for GPUs: 2 unless --gpus N says how many
      gpus=${gpus:-2}
      [[ $gpus =~ ^[1-9][0-9]*$ ]] || mbc_die "--gpus: expected a number of processes, got '$gpus'"
      accelerate_args=(--num_processes "$gpus" --num_machines 1 --mixed_precision no
                       --dynamo_backend no --main_process_port "$(mbc_free_port)")
      (( gpus > 1 )) && accelerate_args=(--multi_gpu "${accelerate_args[@]}")
    fi
  else
    # shellcheck disable=SC1091
    source "$MBC_ROOT/configs/nccl_pcie.env"
    [[ -n $gpus ]] || gpus=$(mbc_count_gpus)
    [[ $gpus =~ ^[1-9][0-9]*$ ]] || mbc_die "cannot tell how many GPUs to use (got '$gpus'); pass --gpus N"
    local config=$MBC_ROOT/configs/accelerate/ddp.yaml
    [[ $deepspeed == 1 ]] && config=$MBC_ROOT/configs/accelerate/deepspeed_zero2.yaml
    if [[ $multinode == 1 ]]; then
      [[ $deepspeed == 1 ]] || config=$MBC_ROOT/configs/accelerate/multinode.yaml
      accelerate_args=(--config_file "$config" --num_machines "$NUM_MACHINES" --machine_rank "$MACHINE_RANK"
                       --main_process_ip "$MASTER_ADDR" --main_process_port "${MASTER_PORT:-29500}"
                       --num_processes $((gpus * NUM_MACHINES)))
    else
      accelerate_args=(--config_file "$config" --num_processes "$gpus" --main_process_port "${MASTER_PORT:-29500}")
    fi
  fi
  local nodes=1
  [[ $multinode == 1 ]] && nodes=$NUM_MACHINES

  # Where this run writes; validates every flag without reading any data.
  local paths OUTPUT_PATH LOG_DIR CHECKPOINT_DIR RESUMED_RUN_ID
  paths=$("$PYTHON" -m diffsynth_mbc.plan --paths-only --gpus "$gpus" --config "$preset" \
          "${train_args[@]+"${train_args[@]}"}") || exit 2
  eval "$paths"
  # Every path the run reads, resolved (relative ones against the current folder) and checked before anything is
  # written: from another folder a preset's data/... and models/... are missing, named here with that folder.
  local reads read_args=(--check-paths --project-root "$MBC_ROOT")
  [[ $cached == 1 ]] && read_args+=(--cached)
  [[ -n $demo_data ]] && read_args+=(--demo-root "$demo_data")
  # Exit 3: a --resume of a run that has ended, said there: nothing to train, so nothing starts (no cache build,
  # no ranks) and nothing is written, as the training itself would end it.
  local checked=0
  reads=$("$PYTHON" -m diffsynth_mbc.plan "${read_args[@]}" --gpus "$gpus" --config "$preset" \
          "${train_args[@]+"${train_args[@]}"}") || checked=$?
  [[ $checked == 3 ]] && exit 0
  [[ $checked == 0 ]] || exit 2
  [[ $demo == 1 || -f $config ]] || mbc_die "the accelerate config $config is missing (a damaged checkout?)"
  if [[ $dry_run == 1 ]]; then
    echo "would run: ${env_prefix[*]+"${env_prefix[*]}"} $PYTHON -m accelerate.commands.launch ${accelerate_args[*]}" \
         "-m diffsynth_mbc.train --config $preset ${train_args[*]+"${train_args[*]}"}"
    echo "output: $OUTPUT_PATH   logs: $LOG_DIR   checkpoints: $CHECKPOINT_DIR"
    echo "launcher flags: demo=$demo deepspeed=$deepspeed multinode=$multinode gpus=$gpus cached=$cached" \
         "detach=$detach skip_doctor=$skip_doctor"
    echo "$reads"
    mbc_dry_run_plan "$preset" "$demo_data" "$gpus" "$nodes" "$cached" "${train_args[@]+"${train_args[@]}"}"
    return
  fi
  mkdir -p "$OUTPUT_PATH" "$LOG_DIR" "$CHECKPOINT_DIR"

  # One training per output, log and checkpoint folder (per node): a second run sharing any of them
  # would replace the first one's monitoring files or prune its checkpoints.
  # A resumed run goes on under its checkpoint's run id, and so does its launch: one run id on the screen
  export MBC_RUN_ID=${MBC_RUN_ID:-${RESUMED_RUN_ID:-$(mbc_new_run_id)}}
  MBC_MULTINODE=$multinode MBC_LOCK_FILES=()
  # Until the supervisor takes over, a launch that stops (a folder already locked, a failed preflight, a
  # failed cache build) removes the run records it wrote, so the next launch finds no "stale lock" of it.
  trap mbc_forget_records EXIT
  mbc_lock 9 "$OUTPUT_PATH" "output folder"
  mbc_lock 8 "$LOG_DIR" "log folder"
  mbc_lock 7 "$CHECKPOINT_DIR" "checkpoint folder"
  # The detail of the launch goes to the run's log; the terminal gets the lines that matter (80 columns).
  local log_file=${MBC_LOG_FILE:-$OUTPUT_PATH/train-$MBC_RUN_ID.log}
  printf '%s\n' "launch of run $MBC_RUN_ID ($(date '+%Y-%m-%d %H:%M:%S')) in $PWD" "$reads" >> "$log_file"

  if [[ -n $demo_data && ${MACHINE_RANK:-0} != 0 && $multinode == 1 ]]; then
    mbc_wait_for_file "$demo_data/metadata/metadata.csv" 300 "node 0 to prepare the demo data"
  elif [[ -n $demo_data ]]; then   # the converter's table only when it fails; its last line (the metadata) in the log
    local prepared
    if prepared=$("$PYTHON" -m diffsynth_mbc.demo prepare "$demo_data" 2>&1); then
      printf '%s\n' "${prepared##*$'\n'}" >> "$log_file"
    else
      printf '%s\n' "$prepared" | tee -a "$log_file" >&2
      echo "error: preparing the demo data under $demo_data failed" >&2
      exit 1
    fi
  fi

  # The plan: its totals, modes and projected run length here; rows, GPUs, batches and the rest in the log.
  local plan_args=(--gpus "$gpus" --nodes "$nodes")
  [[ $cached == 1 ]] && plan_args+=(--cached)
  "$PYTHON" -m diffsynth_mbc.plan --brief --detail-file "$log_file" "${plan_args[@]}" --config "$preset" \
    "${train_args[@]+"${train_args[@]}"}" || exit 2

  # Quick preflight (torch kernels for this GPU, precision, memory estimate, disks, files): a failure stops
  # here, before any process starts; the full report: python -m diffsynth_mbc.doctor --config PRESET ...
  if [[ $skip_doctor == 0 ]]; then
    local doctor_args=(--quick --brief --detail-file "$log_file" --gpus "$gpus" --nodes "$nodes")
    [[ $deepspeed == 1 ]] && doctor_args+=(--deepspeed)
    [[ $cached == 1 ]] && doctor_args+=(--cached)
    if ! "$PYTHON" -m diffsynth_mbc.doctor "${doctor_args[@]}" --config "$preset" \
         "${train_args[@]+"${train_args[@]}"}"; then
      mbc_die "the preflight checks above failed (fix them, or pass --skip_doctor to launch anyway)"
    fi
  fi

  # The owner of the run's processes from here on (diffsynth_mbc.lifecycle.supervisor): it starts accelerate
  # in a session of its own, hands the ranks the locks, stops them on Ctrl-C and marks dead ranks failed.
  local supervise=("$PYTHON" -m diffsynth_mbc.supervise --log-dir "$LOG_DIR" --resume-command "$resume_command") lock
  for lock in "${MBC_LOCK_FILES[@]}"; do supervise+=(--lock "$lock"); done

  if [[ $cached == 1 ]]; then
    if [[ $detach == 1 ]]; then mbc_die "--cached with --detach: build the cache first, then detach the training"; fi
    local CACHE_DIR VAL_CACHE_DIR CACHE_ARGS=() VAL_CACHE_ARGS=() cache_settings
    cache_settings=$("$PYTHON" -m diffsynth_mbc.plan --cache-commands --gpus "$gpus" --config "$preset" \
                     "${train_args[@]+"${train_args[@]}"}") || exit 2
    eval "$cache_settings"
    local cache_launch=("${supervise[@]}" --launcher-pid $$ --log-file "$log_file" --
                        "${env_prefix[@]+"${env_prefix[@]}"}" "$PYTHON" -m accelerate.commands.launch "${accelerate_args[@]}")
    echo "latent cache: $CACHE_DIR" | tee -a "$log_file" >&2
    "${cache_launch[@]}" -m diffsynth_mbc.cache "${CACHE_ARGS[@]}" ||
      { echo "error: building the latent cache failed (see $log_file)" >&2; exit 1; }
    local given=" ${train_args[*]+"${train_args[*]}"} "   # a --cache/--val_cache DIR given already names the cache
    [[ $given == *" --cache "* || $given == *" --cache="* ]] || train_args+=(--cache "$CACHE_DIR")
    if [[ -n $VAL_CACHE_DIR ]]; then
      "${cache_launch[@]}" -m diffsynth_mbc.cache "${VAL_CACHE_ARGS[@]}" ||
        { echo "error: building the validation cache failed (see $log_file)" >&2; exit 1; }
      [[ $given == *" --val_cache "* || $given == *" --val_cache="* ]] || train_args+=(--val_cache "$VAL_CACHE_DIR")
    fi
    mbc_next_rendezvous_port accelerate_args $demo $multinode
  fi
  local cmd=("${env_prefix[@]+"${env_prefix[@]}"}" "$PYTHON" -m accelerate.commands.launch "${accelerate_args[@]}"
             -m diffsynth_mbc.train --config "$preset" "${train_args[@]+"${train_args[@]}"}")
  printf '%s\n' "run $MBC_RUN_ID: ${cmd[*]}" "per-GPU status: $LOG_DIR/training_gpu*.json" >> "$log_file"
  echo "run $MBC_RUN_ID${RESUMED_RUN_ID:+ (resumed)}: $gpus process(es) here; the command is in the log" >&2
  echo "log: $log_file" >&2
  echo "watch: python -m diffsynth_mbc.monitor $(printf %q "$LOG_DIR")" >&2

  if [[ $detach == 1 ]]; then
    # In a session of its own, writing to the log file only; it holds the locks after this shell returns.
    trap - EXIT   # the detached supervisor owns the records now
    setsid "${supervise[@]}" -- "${cmd[@]}" >>"$log_file" 2>&1 < /dev/null &
    echo "started in the background: pid $!   stop: $(mbc_stop_command) $(printf '%q' "$OUTPUT_PATH")" >&2
    return 0
  fi
  local terminal
  if [[ -t 1 ]] && { terminal=$(tty <&3); } 3>&1; then
    # Everything below goes through the supervisor, so rank 0 draws its live bar on this terminal directly (by its
    # name: the ranks run in a session of their own, without /dev/tty) and appends its plain progress
    # lines to the log file instead.
    export MBC_PROGRESS_TTY=$terminal MBC_PROGRESS_LOG=$log_file
  fi
  # This process becomes the supervisor: same pid, same locks; the ranks watch it.
  exec "${supervise[@]}" --log-file "$log_file" -- "${cmd[@]}"
}
