#!/usr/bin/env bash
# The one script that runs spmd's GPU tests and benchmarks on a lent GPU machine.
#
# Usage (from anywhere; it cds to the repository root):
#   benchmarks/run_gpu.sh [STAGE ...]      STAGE: env | tests | fuzz | cm | dispatch | onegpu | decode | train |
#                                          smallar | pdl | twogen | gaps | probe | all
#                                          (default: all)
# Environment knobs:
#   OUT=dir          where logs/results go (default /tmp/spmd_bench_out): run.log, gpu_tests.log,
#                    fuzz_gpu.json, cm_results.json, benchmarks_collective_matmul.png, dispatch_results.json,
#                    one_gpu_results.json, small_allreduce_results.json, benchmarks.md (docs/benchmarks.md
#                    with the new row sets)
#   BUDGET_S=560     wall-clock seconds for all selected stages together (one device call is <= 600 s)
#   STAGE_WEIGHTS=.. shares of BUDGET_S per stage, e.g. "decode=6,tests=2" (defaults in WEIGHT below)
#   TP=N             GPUs to use (default: all visible)
#   CM_ARGS=...      extra options for benchmarks/collective_matmul.py (e.g. "--shapes 4096,4096,4096")
#   DISPATCH_ARGS=.. extra options for benchmarks/dispatch.py
#   ONE_GPU_ARGS=..  extra options for benchmarks/one_gpu.py (e.g. "--rows llama2-2l-bf16-1x1")
#   DECODE_ARGS=..   extra options for benchmarks/decode.py (e.g. "--batch 1 --rounds 2")
#   TRAIN_ARGS=..    extra options for benchmarks/train.py (e.g. "--model gpt3 --layers 1")
#   PDL_ARGS=..      extra options for benchmarks/probe/pdl_chain.py (e.g. "--batch 1 --layers 4")
#   GAPS_ARGS=..    extra options for benchmarks/probe/row_gaps.py (e.g. "--rows llama2-2l-bf16-4x2048")
#   PROBES=..       for stage probe: ';'-separated modules of benchmarks/probe with their options
#                    (e.g. "gelu_erf --rounds 5;attention_choice"), run one after another in the stage's time
#   TWOGEN_ARGS=..   extra options for benchmarks/two_generators.py (e.g. "--layers 8 --rounds 2")
#   SMALLAR_ARGS=..  extra options for benchmarks/small_allreduce.py (e.g. "--sizes 4096 65536 --no-symm")
#   FUZZ_N=400       random programs in the GPU slice of the differential tester (tests/fuzz/sweep.py)
#   PYTEST_ARGS=...  extra options for pytest, split on spaces (e.g. "tests/runtime -x")
#   PYTEST_K=...     a pytest -k expression, passed as one argument (e.g. "fusion_update or programmatic")
#   INSTALL=1        `pip install --no-deps --no-build-isolation -e .` first (default: PYTHONPATH only)
# Every stage runs under `timeout`; a failing stage is logged and the next one still runs.
# The summary table is printed last.

set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
unset XLA_FLAGS

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/spmd_bench_out}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
BUDGET_S="${BUDGET_S:-560}"
TP_ARG=()
[ -n "${TP:-}" ] && TP_ARG=(--tp "$TP")
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
selected=()
for s in "${stages[@]}"; do
  case "$s" in
    all) selected+=(tests fuzz cm dispatch onegpu decode train smallar) ;;
    env|tests|fuzz|cm|dispatch|onegpu|decode|train|smallar|pdl|twogen|gaps|probe) selected+=("$s") ;;
    *) echo "unknown stage '$s': expected env, tests, fuzz, cm, dispatch, onegpu, decode, train, smallar, pdl, twogen, gaps, probe or all"
       exit 2 ;;
  esac
done

declare -A WEIGHT=([tests]=2 [fuzz]=1 [cm]=6 [dispatch]=2 [onegpu]=4 [decode]=3 [train]=2 [smallar]=2 [pdl]=1 [twogen]=2 [gaps]=1 [probe]=1)
# STAGE_WEIGHTS="decode=6,tests=2" overrides the shares of the time budget above.
IFS=',' read -ra _weights <<< "${STAGE_WEIGHTS:-}"
for kv in "${_weights[@]}"; do
  [ -z "$kv" ] && continue
  if ! [[ "${kv#*=}" =~ ^[0-9]+$ ]]; then
    echo "STAGE_WEIGHTS: expected stage=INTEGER pairs (shell arithmetic has no fractions), got '$kv'" >&2; exit 2
  fi
  WEIGHT[${kv%%=*}]=${kv#*=}
done
declare -A RESULT=()
START=$SECONDS

# Seconds for stage $1: its weight's share of the budget left, over the stages still to run.
stage_budget() {
  local left=$(( BUDGET_S - (SECONDS - START) - 10 )) total=0 s seen=0
  for s in "${selected[@]}"; do
    [ "$s" = "$1" ] && seen=1
    [ $seen -eq 1 ] && total=$(( total + ${WEIGHT[$s]:-0} ))
  done
  [ $total -eq 0 ] && { echo 0; return; }
  local b=$(( left * ${WEIGHT[$1]:-0} / total ))
  [ $b -lt 0 ] && b=0
  echo $b
}

run_stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS rc
  echo "=== stage $name: ${secs}s box: $*"
  if [ "$secs" -lt 20 ]; then
    echo "=== stage $name skipped: no time left"; RESULT[$name]="skipped"; return
  fi
  timeout --signal=TERM --kill-after=10 "$secs" "$@"
  rc=$?
  RESULT[$name]="rc=$rc $(( SECONDS - t0 ))s$([ $rc -eq 124 ] && echo ' TIMEOUT')"
  echo "=== stage $name: ${RESULT[$name]}"
}

env_stage() {
  echo "=== env $(date -u +%FT%TZ)"
  timeout 20 nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv || echo "nvidia-smi failed"
  timeout 20 nvidia-smi topo -m || true
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
       "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS XLA_PYTHON_CLIENT_PREALLOCATE=$XLA_PYTHON_CLIENT_PREALLOCATE"
  timeout 60 python3 -c 'from benchmarks.reporting import hardware_info; print(hardware_info())' || echo "version probe failed"
  if [ "${INSTALL:-0}" = 1 ]; then
    timeout 90 python3 -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 \
      && echo "pip install -e . ok" || echo "pip install -e . failed; using PYTHONPATH=$REPO"
  else
    echo "using PYTHONPATH=$REPO (INSTALL=1 to pip install -e . first)"
  fi
}

tests_stage() {
  local secs=$1 extra=()
  python3 -c 'import pytest_timeout' 2>/dev/null && extra=(--timeout=120)
  [ -n "${PYTEST_K:-}" ] && extra+=(-k "$PYTEST_K")
  # shellcheck disable=SC2086
  # -v: the log names every test that finished, also when the time box cuts the stage short;
  # --durations: the slowest tests, to keep the stage inside one device call
  run_stage tests "$secs" python3 -m pytest -m "gpu and not slow" -v -p no:cacheprovider --durations=30 \
    "${extra[@]}" ${PYTEST_ARGS:-} >"$OUT/gpu_tests.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -n 20
  tail -n 40 "$OUT/gpu_tests.log"
}

env_stage
for s in "${selected[@]}"; do
  secs=$(stage_budget "$s")
  case "$s" in
    env) ;;
    tests) tests_stage "$secs" ;;
    # shellcheck disable=SC2086
    cm) run_stage cm "$secs" python3 -m benchmarks.collective_matmul "${TP_ARG[@]}" --out "$OUT" \
          --doc docs/benchmarks.md --budget-s $(( secs - 15 )) ${CM_ARGS:-} ;;
    # shellcheck disable=SC2086
    dispatch) run_stage dispatch "$secs" python3 -m benchmarks.dispatch "${TP_ARG[@]}" --out "$OUT" \
          --doc docs/benchmarks.md --budget-s $(( secs - 10 )) ${DISPATCH_ARGS:-} ;;
    # shellcheck disable=SC2086
    onegpu) run_stage onegpu "$secs" python3 -m benchmarks.one_gpu --out "$OUT" --doc docs/benchmarks.md \
          ${ONE_GPU_ARGS:-} ;;
    # shellcheck disable=SC2086
    decode) run_stage decode "$secs" python3 -m benchmarks.decode --doc ${DECODE_ARGS:-} ;;
    # shellcheck disable=SC2086
    train) run_stage train "$secs" python3 -m benchmarks.train --doc docs/benchmarks.md ${TRAIN_ARGS:-} ;;
    # shellcheck disable=SC2086
    smallar) run_stage smallar "$secs" python3 -m benchmarks.small_allreduce "${TP_ARG[@]}" --symm --out "$OUT" \
          --doc docs/benchmarks.md ${SMALLAR_ARGS:-} ;;
    # shellcheck disable=SC2086
    gaps) run_stage gaps "$secs" python3 -m benchmarks.probe.row_gaps ${GAPS_ARGS:-} ;;
    probe) run_stage probe "$secs" bash -c 'IFS=";" read -ra ps <<< "${PROBES:-}"
          for p in "${ps[@]}"; do echo "--- probe $p"; read -ra argv <<< "$p"
            python3 -m "benchmarks.probe.${argv[0]}" "${argv[@]:1}"; done' ;;
    # shellcheck disable=SC2086
    pdl) run_stage pdl "$secs" python3 -m benchmarks.probe.pdl_chain --doc docs/benchmarks.md ${PDL_ARGS:-} ;;
    # shellcheck disable=SC2086
    twogen) run_stage twogen "$secs" python3 -m benchmarks.two_generators ${TWOGEN_ARGS:-} ;;
    fuzz) run_stage fuzz "$secs" python3 -m tests.fuzz.sweep --device cuda --n "${FUZZ_N:-400}" --seed "$RANDOM" \
          --budget-s $(( secs - 20 )) --out "$OUT/fuzz_gpu.json" ;;
  esac
done

[ -f docs/benchmarks.md ] && cp docs/benchmarks.md "$OUT/benchmarks.md"
echo "=== summary ($(( SECONDS - START ))s total)"
for s in "${selected[@]}"; do [ "$s" != env ] && echo "stage $s: ${RESULT[$s]:-not run}"; done
timeout 30 python3 -m benchmarks.summarize "$OUT" || echo "summary failed"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null || true
