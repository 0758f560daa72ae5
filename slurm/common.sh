# shellcheck shell=bash
# Shared by slurm/*.sbatch (sourced, not run): where the project and its Python are, the
# allocation's first node, and the two job bodies: torchrun training and a Ray cluster for
# pipeline.prepare.
#
# sbatch copies a batch script into slurmd's spool directory, so a script cannot find its
# siblings by its own path: the project is $PROJECT_DIR, by default the directory `sbatch`
# was run from (submit from the project root, or pass --export=ALL,PROJECT_DIR=...).

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$PROJECT_DIR" || exit 2

log() { echo "[$(date '+%F %T')] $*" >&2; }
die() { log "error: $*"; exit 2; }

[[ -f launch/train/loop.py && -f pipeline/prepare/job.py ]] ||
    die "PROJECT_DIR=$PROJECT_DIR is not the project (submit from its root or set PROJECT_DIR)"

# The interpreter of the project's environment: $PYTHON, else .venv/bin/python, else python3.
# It is not resolved through symlinks: a venv's python must be called by its own path.
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$PROJECT_DIR/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
export PYTHONPATH=$PROJECT_DIR${PYTHONPATH:+:$PYTHONPATH}
# sbatch's --cpus-per-task is not inherited by srun since Slurm 22.05.
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK

# The allocation's first node, and a node's address: its NodeAddr, which is its name on most
# clusters (and 127.0.0.1 on slurm/local-cluster.sh's emulated nodes), else, where SLURM reports
# none, the node's name (check_addr then makes sure it resolves). awk reads the whole list:
# `head -n 1` may exit before scontrol has written its last name, and the SIGPIPE that scontrol
# then gets ends the script (exit 141) under pipefail; grep finding nothing must not end it either.
head_node() { scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1'; }
node_addr() {
    local addr
    addr=$(scontrol show node "$1" | { grep -o 'NodeAddr=[^ ]*' || true; } | awk -F= 'NR == 1 {print $2}')
    echo "${addr:-$1}"
}

# A port every node derives from the job id alone (a requeued job keeps its id).
job_port() { echo $((${1:-20000} + SLURM_JOB_ID % 10000)); }

# Sum of SLURM_JOB_CPUS_PER_NODE, written like "8(x2),4".
job_cpus() {
    local total=0 items item count times
    IFS=, read -ra items <<<"${SLURM_JOB_CPUS_PER_NODE:-1}"
    for item in "${items[@]}"; do
        count=${item%%(*}
        times=1
        [[ $item == *"(x"* ]] && times=${item##*(x} && times=${times%)}
        total=$((total + count * times))
    done
    echo "$total"
}

# Wait for a background srun and return its status. A trapped signal interrupts `wait`
# (the handler sets TRAPPED): then wait again, for srun's own status.
TRAPPED=0
wait_for_step() {
    local pid=$1 status=0 last
    while true; do
        TRAPPED=0
        wait "$pid" && last=0 || last=$?
        # 127: srun's status was already collected, by a wait that a signal then cut short.
        ((last == 127)) && return "$status"
        status=$last
        ((TRAPPED)) || return "$status"
    done
}

print_job() {
    log "job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_JOB_NUM_NODES} node(s) $SLURM_JOB_NODELIST," \
        "project $PROJECT_DIR, python $PYTHON"
}

# NCCL's settings reach every rank: the NCCL_* and TORCH_NCCL_* variables of the submitting
# shell (sbatch passes its environment on; srun --export=ALL below passes the batch script's)
# or set here, e.g. NCCL_SOCKET_IFNAME=ib0 (the interface for the bootstrap and socket
# transport), NCCL_IB_HCA=mlx5 (the InfiniBand adapters), NCCL_IB_DISABLE=1 (no InfiniBand),
# NCCL_DEBUG=INFO (what NCCL chose, per rank). One default: a collective that fails or times
# out raises in the rank (TORCH_NCCL_ASYNC_ERROR_HANDLING=1), so the job ends instead of hanging.
nccl_env() {
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    local settings
    settings=$(env | grep -E '^(TORCH_)?NCCL_' | sort | tr '\n' ' ')
    log "NCCL settings passed to the ranks: ${settings:-none}"
}

# W&B's settings reach the ranks with the rest of the environment (srun --export=ALL); the log
# says which were set (a key's value hidden), since a config's wandb.* keys win over them.
wandb_env() {
    local settings
    settings=$(env | { grep -E '^WANDB_' || true; } | sed -E 's/^(WANDB_API_KEY)=.*/\1=(set)/' | sort | tr '\n' ' ')
    log "W&B settings passed to the ranks: ${settings:-none (offline, unless the config sets wandb.mode)}"
}

# The rendezvous host must resolve on every node; falling back to this one would leave the
# other nodes waiting until the rendezvous times out.
check_addr() {
    getent hosts "$1" >/dev/null 2>&1 || getent ahosts "$1" >/dev/null 2>&1 ||
        die "the first node's address '$1' ($2) does not resolve: the nodes could not meet there (set its NodeAddr in SLURM, or fix DNS)"
}

# ----------------------------------------------------------------------------- training

# The run directory the trainer will use (config + overrides resolved the trainer's way);
# a bad config fails here, before any node is started.
resolve_run_dir() {
    "$PYTHON" - "$@" <<'EOF'
import os
import sys

from launch.config import TrainConfig
from common.configure import UserError, load_config

try:
    cfg = load_config(TrainConfig, sys.argv[1], sys.argv[2:])
except UserError as err:
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(2)
print(os.path.abspath(cfg.run_dir))
EOF
}

# launch.preflight, once, on the batch host, with the world the ranks will have: a bad config,
# dataset, warm-start source or run_dir fails the job in seconds, every problem listed in its
# log, instead of after every node has started and met. PREFLIGHT=0 skips it.
preflight() {
    local world=$1 per_node=$2
    shift 2
    if [[ ${PREFLIGHT:-1} == 0 ]]; then
        log "preflight skipped (PREFLIGHT=0)"
        return 0
    fi
    "$PYTHON" -m launch.preflight --world-size "$world" --ranks-per-node "$per_node" "$@"
}

# One torchrun per node (an srun task), which starts that node's ranks; the rendezvous is
# torch's c10d store on the first node. GPUs per node come from the allocation
# (--gpus-per-node); on CPU, NPROC_PER_NODE ranks per node (default 1).
RUN_DIR=""
WARNED=0

# SLURM's warning signal (--signal=B:USR1@SECONDS) reaches this shell only: ask the trainer,
# through its stop file, to checkpoint at the end of the current step. A warning that comes
# before the run directory is known is passed on as soon as it is. The other catchable signals
# sent before a kill (`scancel --batch --signal=...`, this shell's own CPU-time or file size
# limit) are such a warning too, rather than the end of this shell (whose job SLURM would then
# end, the ranks perhaps killed before their checkpoint, and not requeued). SIGTERM and SIGINT
# are a cancellation: SLURM sends them to the ranks too, which checkpoint, and no requeue follows.
WARNING_SIGNALS=(USR1 HUP QUIT XCPU XFSZ)
on_warning() {
    TRAPPED=1
    WARNED=1
    log "warning signal${1:+ (SIG$1)}: asking the trainer to checkpoint and stop"
    [[ -n $RUN_DIR ]] && touch "$RUN_DIR/STOP"
    return 0
}

train_job() {
    local signal
    for signal in "${WARNING_SIGNALS[@]}"; do
        # the signal's name expanded now, on purpose
        # shellcheck disable=SC2064
        trap "on_warning $signal" "$signal"
    done
    (($# >= 1)) || die "usage: sbatch [sbatch flags] ${SLURM_JOB_NAME:-pretrain}.sbatch CONFIG.yaml [key.sub=value ...]"
    print_job
    local run_dir nproc head head_addr port status
    run_dir=$(resolve_run_dir "$@") || exit 2
    nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
    preflight $((SLURM_JOB_NUM_NODES * nproc)) "$nproc" "$@" || die "preflight failed (above): no rank started (PREFLIGHT=0 skips it)"
    mkdir -p "$run_dir"
    # Left from a run that ended just as the warning came: they must not stop this one.
    rm -f "$run_dir/STOP" "$run_dir/preempted.json"
    RUN_DIR=$run_dir
    ((WARNED)) && touch "$run_dir/STOP"
    head=$(head_node)
    head_addr=$(node_addr "$head")
    check_addr "$head_addr" "$head"
    nccl_env
    wandb_env
    port=$(job_port "${RDZV_PORT_BASE:-20000}")
    log "run_dir $run_dir; $SLURM_JOB_NUM_NODES x $nproc ranks; rendezvous $head_addr:$port ($head)"

    # The CPUs allocated per task are shared by the node's ranks (the trainer would otherwise
    # count the whole machine's cores); the user's own threads_per_rank, later, still wins.
    local args=("$1")
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && args+=("threads_per_rank=$(((SLURM_CPUS_PER_TASK + nproc - 1) / nproc))")
    args+=("${@:2}")
    # --kill-on-bad-exit: a node whose ranks fail ends the others at once, instead of
    # leaving them waiting in a collective until dist_timeout_s.
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        --export=ALL "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$nproc" \
        --rdzv_backend=c10d --rdzv_endpoint="$head_addr:$port" --rdzv_id="$SLURM_JOB_ID" --max_restarts=0 \
        -m launch.train "${args[@]}" &
    wait_for_step $! && status=0 || status=$?
    trap - "${WARNING_SIGNALS[@]}"

    if ((status == 0)) && [[ -f $run_dir/preempted.json ]]; then
        log "checkpoint saved at $(cat "$run_dir/preempted.json"): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        # slurmctld now ends this run; the requeued one resumes from the checkpoint.
        sleep 60
        exit 0
    fi
    log "training ended with status $status"
    exit "$status"
}

# ----------------------------------------------------------------------------- Ray

RAY_PIDS=()

stop_ray() {
    ((${#RAY_PIDS[@]})) || return 0
    log "stopping Ray"
    # srun answers SIGTERM by ending its job step, and SLURM ends every process of a step:
    # raylets, GCS and workers included, on every node. (`ray stop` would also end other
    # Ray instances of the same user on those nodes.)
    kill -TERM "${RAY_PIDS[@]}" 2>/dev/null || true
    for pid in "${RAY_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    RAY_PIDS=()
}

# Count the live nodes of the Ray cluster at $1 until there are $2 (or time runs out).
wait_for_ray_nodes() {
    "$PYTHON" - "$1" "$2" "${RAY_WAIT_S:-180}" <<'EOF'
import sys
import time

import ray

address, want, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + limit

while True:
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        break
    except (ConnectionError, RuntimeError) as err:
        if time.time() > deadline:
            raise SystemExit(f"error: no Ray head at {address}: {err}")
        time.sleep(2)
while (alive := sum(node["Alive"] for node in ray.nodes())) < want:
    if time.time() > deadline:
        raise SystemExit(f"error: {alive} of {want} Ray nodes joined within {limit:.0f} s")
    time.sleep(1)
print(f"Ray cluster at {address}: {alive} nodes, {ray.cluster_resources().get('CPU', 0):.0f} CPUs", file=sys.stderr)
EOF
}

# A Ray head on the first node and a Ray worker on each other node (srun steps that live as
# long as this job needs them), then pipeline.prepare as a driver of that cluster.
prepare_job() {
    (($# >= 1)) || die "usage: sbatch [sbatch flags] prepare.sbatch CONFIG.yaml [key.sub=value ...]"
    print_job
    local head head_addr port nodes cpus status
    head=$(head_node)
    head_addr=$(node_addr "$head")
    check_addr "$head_addr" "$head"
    port=$(job_port "${RAY_PORT_BASE:-30000}")
    nodes=$SLURM_JOB_NUM_NODES
    cpus=$(job_cpus)
    # Ray 2.x's token authentication: one fresh token for this job's cluster and its driver.
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
    export RAY_USAGE_STATS_ENABLED=0
    local ray=("$PYTHON" -m ray.scripts.scripts start --block --disable-usage-stats)
    trap stop_ray EXIT
    log "Ray head on $head ($head_addr:$port), $nodes node(s), $cpus CPUs"

    # --num-cpus from each node's own allocation: the task reads SLURM_CPUS_ON_NODE there.
    # shellcheck disable=SC2016
    srun --job-name=ray-head --nodes=1 --ntasks=1 --nodelist="$head" --overlap \
        bash -c 'exec "$@" --num-cpus="${SLURM_CPUS_ON_NODE:-1}"' ray "${ray[@]}" \
        --head --node-ip-address="$head_addr" --port="$port" --include-dashboard=false &
    RAY_PIDS+=($!)
    if ((nodes > 1)); then
        # shellcheck disable=SC2016
        srun --job-name=ray-worker --nodes=$((nodes - 1)) --ntasks=$((nodes - 1)) --ntasks-per-node=1 --exclude="$head" --overlap \
            bash -c 'exec "$@" --num-cpus="${SLURM_CPUS_ON_NODE:-1}"' ray "${ray[@]}" \
            --address="$head_addr:$port" &
        RAY_PIDS+=($!)
    fi
    wait_for_ray_nodes "$head_addr:$port" "$nodes" || exit 1

    "$PYTHON" -m pipeline.prepare "$1" "ray.address=$head_addr:$port" "ray.num_workers=$cpus" "${@:2}" &&
        status=0 || status=$?
    stop_ray
    log "prepare ended with status $status"
    exit "$status"
}
