#!/usr/bin/env bash
# The GPU check of this project on a node with no network (docs/gpu.md).
#
#   bash benchmarks/gpu_check.sh [BUNDLE_DIR]        # from anywhere; BUNDLE_DIR default build/gpu-bundle
#
# BUNDLE_DIR is what `make gpu-bundle` made where PyPI is reachable: wheels/ (a wheelhouse for the
# node's Python, with requirements.txt and bundle.txt) and data/ (a dataset prepared at seq_len 1024).
# Stages, each bounded by `timeout` so that the whole check ends within BUDGET seconds; a stage that
# fails is recorded and the next one runs, except the first three, which stop the check:
#   torch      the node's torch is used as it is: present and at least pyproject.toml's minimum (else exit 2)
#   install    pip install --no-index from BUNDLE_DIR/wheels of what the environment lacks (torch, triton
#              and nvidia-* pinned to what is installed, so pip can never replace them), then imports
#   cuda       torch can use the GPU, or one line saying why not, and exit 3
#   probes     the fused loss's GEMM mode, every TF32 getter after launch.metrics.set_fp32_matmul(True),
#              torch.compile of a small function on the GPU, deepspeed's accelerator
#   bench      benchmarks/bench_gpu.py, GPT-2 124M shapes, ZeRO-1, vocabularies 50,257 and the data's,
#              each timed for at least 15 s (the clock a GPU holds under sustained load, as training)
#   train      launch.train configs/gpt2_small.yaml in bf16 on BUNDLE_DIR/data for TRAIN_S seconds,
#              stopped through the run directory's STOP file (the trainer checkpoints and exits);
#              steps 301-303 profiled (profile_start: where the step's time goes, in check.log)
#   train-vs-bench   the run's steady-state tokens/s and MFU against the bench row of the same
#              vocabulary and ZeRO stage (fails outside 10%)
#   train-1b   launch.train configs/llama_gpu_1b.yaml (Llama-shaped, 1.08 B parameters at 50,257
#              pieces) on BUNDLE_DIR/data2048 for TRAIN_1B_S seconds, as the train stage; its
#              dry run's memory estimate (llama_1b_dry_run.json) against the measured peak
#   hf-bench   benchmarks/bench_train.py on the GPU, one process: ours against transformers'
#              GPT2LMHeadModel (GPT-2 124M shape, data/) and LlamaForCausalLM (the 1 B shape,
#              data2048/), same weights and batches, both compiled, bf16, ZeRO-1, alternating
#              (HF_BENCH=0 skips it)
#   pytest     REQUIRE_GPU=1 pytest -m gpu with the time left (skipped under 60 s)
# Environment: OUT (default ./gpu_check_out: check.log, summary.txt, bench_gpu.json,
# train_metrics.jsonl, train_1b_metrics.jsonl, llama_1b_dry_run.json, bench_train.txt,
# nvidia_smi.csv, pip_freeze.txt), WORK (default $TMPDIR or /tmp, then gpu_check_work: the run
# directories, with their checkpoints), BUDGET (seconds, default 600), TRAIN_S (default 120),
# TRAIN_1B_S (default 90), TRAIN_ARGS (more key=value overrides for the train stage),
# PYTHON (default python3: the environment that is checked and installed into).
# Exit status: 0 all stages passed (some may be skipped for time), 1 a stage failed, 2 no usable
# torch or bundle, 3 CUDA unusable, 130 interrupted.
set -uo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 2
# Paths given are taken from where the script is started; the defaults are the repository's.
BUNDLE=$(realpath -m -- "${1:-$ROOT/build/gpu-bundle}")
OUT=$(realpath -m -- "${OUT:-$ROOT/gpu_check_out}")
WORK=$(realpath -m -- "${WORK:-${TMPDIR:-/tmp}/gpu_check_work}")
BUDGET=${BUDGET:-600}
TRAIN_S=${TRAIN_S:-120}
TRAIN_1B_S=${TRAIN_1B_S:-90}
HF_BENCH=${HF_BENCH:-1}
PY=$(command -v "${PYTHON:-python3}") || { echo "gpu_check: no Python '${PYTHON:-python3}' (set PYTHON)" >&2; exit 2; }
[[ $PY == /* ]] || PY=$PWD/$PY   # a venv's python by its own path (not resolved: that would leave the venv)
cd "$ROOT" || exit 2
for v in BUDGET TRAIN_S TRAIN_1B_S HF_BENCH; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "gpu_check: $v=${!v}: not a number of seconds" >&2; exit 2; }
done
mkdir -p "$OUT" "$WORK" || exit 2
# Only this script's own files are replaced: OUT may hold other things.
rm -f "$OUT"/{check.log,summary.txt,bench_gpu.json,train_metrics.jsonl,train_1b_metrics.jsonl,llama_1b_dry_run.json,bench_train.txt,nvidia_smi.csv,pip_freeze.txt}
rm -rf "$WORK/run" "$WORK/run_1b" "$WORK/cuda_stop.txt"
RUN=$WORK/run RUN_1B=$WORK/run_1b

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # `python -m launch.train` without installing the project
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1         # no network: fail at once, not after a timeout
export WANDB_SILENT=true RAY_USAGE_STATS_ENABLED=0
export GPU_CHECK_OUT=$OUT GPU_CHECK_WORK=$WORK GPU_CHECK_ROOT=$ROOT
unset SIG NOTE   # stage() reads them, set per call

HELPER=$ROOT/benchmarks/gpu_check.py


START=$SECONDS
FAILED=() SKIPPED=()
CHILD='' TIMER='' SAMPLER=''
left() { echo $(( BUDGET - (SECONDS - START) )); }
# limit CAP RESERVE: a stage's time limit: CAP at most, leaving RESERVE seconds for the stages after it
limit() { local t=$(( $(left) - $2 )); (( t > $1 )) && t=$1; echo $(( t > 0 ? t : 0 )); }
say() { printf '\n== [%ss elapsed, %ss left] %s\n' $(( SECONDS - START )) "$(left)" "$*"; }
record() {  # NAME RC SECONDS NOTE: one line of summary.txt
  printf '%-15s rc=%-4s %4ss  %s\n' "$1" "$2" "$3" "${4:-}" >> "$OUT/summary.txt"
}
# stage NAME LIMIT COMMAND...: runs COMMAND under `timeout` (signal $SIG, default TERM; KILL 15 s
# later), records it and returns its status; a limit under 10 s skips it.
stage() {
  local name=$1 lim=$2; shift 2
  if (( lim < 10 )); then
    say "$name: skipped, ${lim}s left of BUDGET=$BUDGET"
    record "$name" - 0 "skipped: out of time (BUDGET=$BUDGET)"; SKIPPED+=("$name"); return 124
  fi
  say "$name (limit ${lim}s): $*"
  local t0=$SECONDS rc
  timeout -s "${SIG:-TERM}" -k 15 "$lim" "$@" &
  CHILD=$!
  wait "$CHILD"; rc=$?; CHILD=''
  local note=${NOTE:-}
  (( rc == 124 || rc == 137 )) && note="timed out after ${lim}s${note:+; $note}"
  record "$name" "$rc" $(( SECONDS - t0 )) "$note"
  (( rc == 0 )) || FAILED+=("$name")
  return "$rc"
}
verdict() {  # the last line of summary.txt and of the log
  local line
  if [[ -n ${1:-} ]]; then line="verdict: $1"
  elif (( ${#FAILED[@]} )); then line="verdict: FAIL: failed: ${FAILED[*]}${SKIPPED:+; skipped: ${SKIPPED[*]}}"
  elif (( ${#SKIPPED[@]} )); then line="verdict: PASS, but skipped: ${SKIPPED[*]}"
  else line="verdict: PASS: every stage passed"; fi
  line+=" ($(( SECONDS - START ))s of BUDGET=${BUDGET}s; log $OUT/check.log)"
  echo "$line" >> "$OUT/summary.txt"
  printf '\n%s\n' "$line"
  echo "---- $OUT/summary.txt"; cat "$OUT/summary.txt"
}
stop_children() {  # only the processes this script started
  for pid in $CHILD $TIMER $SAMPLER; do kill -TERM "$pid" 2>/dev/null; done
}
interrupted() {
  stop_children; wait 2>/dev/null
  verdict "INTERRUPTED"; exit 130
}

main() {
  trap interrupted INT TERM HUP
  trap stop_children EXIT
  local commit tree
  if commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit+=" + local changes"
  else commit="no git"; fi
  # The tree's own fingerprint, for a copy without .git: its Python and YAML files
  tree=$(cd "$ROOT" && find launch model pipeline benchmarks configs tests -type f \( -name '*.py' -o -name '*.yaml' \) \
    -not -path '*/__pycache__/*' -print0 2>/dev/null | sort -z | xargs -0 cat 2>/dev/null | sha256sum | cut -c1-12)
  echo "# gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname); repo $ROOT ($commit; sources sha256 $tree); bundle $BUNDLE; BUDGET=${BUDGET}s TRAIN_S=${TRAIN_S}s" > "$OUT/summary.txt"
  say "machine"
  echo "$(uname -srm); $(nproc) CPUs; $(awk '/MemTotal/ {printf "%.0f GiB memory", $2 / 2^20}' /proc/meminfo 2>/dev/null); python: $PY ($("$PY" --version 2>&1))"
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv
    nvidia-smi | sed -n '3p'   # the driver's CUDA version
    echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" >> "$OUT/summary.txt"
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,temperature.gpu,clocks.sm \
      --format=csv -l 5 > "$OUT/nvidia_smi.csv" 2>/dev/null &
    SAMPLER=$!
  else
    echo "nvidia-smi: $(command -v nvidia-smi >/dev/null && echo 'present, but it lists no GPU' || echo 'not found')"
  fi
  command -v gcc >/dev/null && echo "gcc: $(gcc -dumpfullversion 2>/dev/null)" || echo "gcc: none (Triton, so torch.compile, needs a C compiler)"
  echo "bundle $BUNDLE:"; du -sh "$BUNDLE/wheels" "$BUNDLE/data" "$BUNDLE/tiny_dataset" 2>&1 | sed 's/^/  /'
  [[ -f $BUNDLE/wheels/bundle.txt ]] && sed 's/^/  wheels: /' "$BUNDLE/wheels/bundle.txt"

  stage torch "$(limit 60 30)" "$PY" "$HELPER" torch
  rc=$?; if (( rc != 0 )); then verdict "STOPPED: no usable torch (rc=$rc)"; return 2; fi

  stage install "$(limit 180 30)" "$PY" "$HELPER" install "$BUNDLE"
  rc=$?; if (( rc == 2 )); then verdict "STOPPED: no wheelhouse at $BUNDLE/wheels (make gpu-wheelhouse)"; return 2; fi

  stage cuda "$(limit 60 20)" "$PY" "$HELPER" cuda
  rc=$?
  if (( rc != 0 )); then
    local why; why=$(cat "$WORK/cuda_stop.txt" 2>/dev/null)
    verdict "STOPPED at the CUDA probe (rc=$rc), nothing after it ran: ${why:-see the cuda stage in check.log}"
    return 3
  fi

  stage probes "$(limit 150 240)" "$PY" "$HELPER" probes

  local vocab data_ok=1
  vocab=$("$PY" "$HELPER" data "$BUNDLE")
  if [[ -z $vocab || $vocab == 0 ]]; then
    vocab=8000 data_ok=0; echo "data: no usable dataset in $BUNDLE/data (make gpu-data): the train stage will be skipped"
  fi
  local vocabs=50257
  [[ $vocab == 50257 ]] || vocabs+=",$vocab"
  SIG=INT stage bench "$(limit 180 200)" "$PY" benchmarks/bench_gpu.py --vocabs "$vocabs" --stages 1 \
    --steps 5 --warmup 2 --min-seconds 15 --json "$OUT/bench_gpu.json"

  local wandb=disabled train_s lim
  "$PY" -c 'import wandb' 2>/dev/null && wandb=offline
  export WANDB_MODE=$wandb
  lim=$(limit $(( TRAIN_S + 90 )) 75)
  train_s=$(( lim - 60 < TRAIN_S ? lim - 60 : TRAIN_S ))   # 60 s for the checkpoint on STOP and the exit
  if (( ! data_ok )); then
    record train - 0 "skipped: no usable $BUNDLE/data (make gpu-data)"; SKIPPED+=(train)
  elif (( train_s < 30 )); then
    record train - 0 "skipped: ${lim}s left for it"; SKIPPED+=(train)
  else
    mkdir -p "$RUN"
    ( trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM; sleep "$train_s" & sleeper=$!; wait "$sleeper" && touch "$RUN/STOP" ) &
    TIMER=$!
    NOTE="STOP after ${train_s}s, wandb $wandb" stage train "$lim" "$PY" -m launch.train configs/gpt2_small.yaml \
      "data.data_dir=$BUNDLE/data" "run_dir=$RUN" deepspeed.precision=bf16 log_every=10 eval_every=0 \
      checkpoint.every_steps=0 max_steps=100000 "wandb.mode=$wandb" profile_start=300 profile_steps=3 ${TRAIN_ARGS:-}
    kill "$TIMER" 2>/dev/null; wait "$TIMER" 2>/dev/null; TIMER=''
    [[ -f $RUN/preempted.json ]] && echo "train: stopped through $RUN/STOP: $(cat "$RUN/preempted.json")" \
      || echo "train: WARNING: no $RUN/preempted.json: it did not stop through its STOP file"
    cp "$RUN/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null
    stage train-vs-bench "$(limit 60 25)" "$PY" "$HELPER" compare "$RUN/metrics.jsonl" "$OUT/bench_gpu.json" "$vocab" 1
  fi

  # The Llama-shaped 1 B model: its dry run's memory estimate, then TRAIN_1B_S seconds of training
  local data_1b=$BUNDLE/data2048
  lim=$(limit $(( TRAIN_1B_S + 100 )) 60)
  train_s=$(( lim - 70 < TRAIN_1B_S ? lim - 70 : TRAIN_1B_S ))
  if [[ ! -f $data_1b/manifest.json ]]; then
    record train-1b - 0 "skipped: no $data_1b (make gpu-data)"; SKIPPED+=(train-1b)
  elif (( train_s < 40 )); then
    record train-1b - 0 "skipped: ${lim}s left for it"; SKIPPED+=(train-1b)
  else
    local args_1b=("data.data_dir=$data_1b" "run_dir=$RUN_1B" log_every=5 eval_every=0
      checkpoint.every_steps=0 max_steps=100000 "wandb.mode=$wandb")
    "$PY" -m launch.train configs/llama_gpu_1b.yaml "${args_1b[@]}" --dry-run --json \
      > "$OUT/llama_1b_dry_run.json" 2>/dev/null || echo "train-1b: the dry run failed (rc=$?)"
    mkdir -p "$RUN_1B"
    ( trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM; sleep "$train_s" & sleeper=$!; wait "$sleeper" && touch "$RUN_1B/STOP" ) &
    TIMER=$!
    NOTE="STOP after ${train_s}s" stage train-1b "$lim" "$PY" -m launch.train configs/llama_gpu_1b.yaml "${args_1b[@]}"
    kill "$TIMER" 2>/dev/null; wait "$TIMER" 2>/dev/null; TIMER=''
    cp "$RUN_1B/metrics.jsonl" "$OUT/train_1b_metrics.jsonl" 2>/dev/null
    stage train-1b-figures "$(limit 30 25)" "$PY" "$HELPER" train-1b "$RUN_1B/metrics.jsonl" "$OUT/llama_1b_dry_run.json"
    rm -rf "$RUN_1B"   # a 1 B model's checkpoint: 13 GB the check does not need
  fi

  # Ours against Hugging Face on this GPU, both compiled
  if (( ! HF_BENCH )); then
    record hf-bench - 0 "skipped: HF_BENCH=0"; SKIPPED+=(hf-bench)
  elif (( ! data_ok )) || [[ ! -f $data_1b/manifest.json ]]; then
    record hf-bench - 0 "skipped: no usable $BUNDLE/data or $data_1b"; SKIPPED+=(hf-bench)
  else
    local bt=("$PY" benchmarks/bench_train.py --nproc 1 --precisions bf16 --compile on --zero-stage 1
      --steps 6 --rounds 2)
    export GPU_CHECK_D1=$BUNDLE/data GPU_CHECK_D2=$data_1b
    # shellcheck disable=SC2016  # expanded by the inner bash
    SIG=INT stage hf-bench "$(limit 240 25)" bash -c '{ "$@" --archs gpt --shapes base --micro-batch 16 \
      --data "$GPU_CHECK_D1" && "$@" --archs llama --shapes 1b --micro-batch 4 --data "$GPU_CHECK_D2"; } 2>&1 \
      | tee "$GPU_CHECK_OUT/bench_train.txt"; exit "${PIPESTATUS[0]}"' hf-bench "${bt[@]}"
  fi

  lim=$(limit 100000 25)   # pytest gets SIGINT at the limit, then 15 s to print what it ran
  if (( lim < 60 )); then
    say "pytest: skipped, ${lim}s left (run with a larger BUDGET)"
    record pytest - 0 "skipped: ${lim}s left (BUDGET=$BUDGET)"; SKIPPED+=(pytest)
  else
    [[ -f $BUNDLE/tiny_dataset/manifest.json ]] && export TINY_DATASET=$BUNDLE/tiny_dataset
    REQUIRE_GPU=1 SIG=INT NOTE="REQUIRE_GPU=1 -m gpu" stage pytest "$lim" \
      "$PY" -m pytest -m gpu -q -rfEs --durations=15 -p no:cacheprovider tests/
  fi
  verdict
  (( ${#FAILED[@]} == 0 ))
}

# tee ignores Ctrl-C, so the log keeps what main prints while it stops
main "$@" 2>&1 | ( trap '' INT TERM HUP; exec tee "$OUT/check.log" )
exit "${PIPESTATUS[0]}"
