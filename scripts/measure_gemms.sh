#!/usr/bin/env bash
# GEMM rates by shape for the planner (chapter 12), the prepared run for a GPU machine. From the checkout:
#   scripts/measure_gemms.sh [--out DIR] [--model PRESET] [--seconds S]   # llama3-405b: ~2 min on one H100/H200
# 1. `python -m minidist.plan --measure-gemms`: every shape of the model's linears (forward, input and weight
#    gradients; tp 1 to 8; 128 to 32,768 rows) timed on this machine's GPU in bf16, written to DIR/PRESET.json.
# 2. (on a GPU, llama3-405b) Llama 3's 16,384-GPU setting planned with that table, with Megatron's kernels and with
#    this trainer's: the published layout explained (its linears' measured rate, its rank), and the first 12.
#    On a CPU the table is measured only: a CPU's rates cannot plan a GPU (the planner refuses them).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
OUT=""
MODEL=llama3-405b
SECONDS_PER_SHAPE=0.05
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --seconds) SECONDS_PER_SHAPE="$2"; shift 2 ;;
    *) echo "usage: scripts/measure_gemms.sh [--out DIR] [--model PRESET] [--seconds S]" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
TABLE="$OUT/$MODEL.json"
started=$(date +%s)

echo "== 1. GEMM rates by shape for $MODEL"
"$PY" -m minidist.plan --model "$MODEL" --measure-gemms "$TABLE" --measure-seconds "$SECONDS_PER_SHAPE"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "measure_gemms: no GPU here, the table is measured only ($TABLE); $(( $(date +%s) - started )) s"
  exit 0
fi
if [ "$MODEL" = llama3-405b ]; then
  LLAMA=(--model llama3-405b --gpus 16384 --gpu H100-SXM --seq-len 8192 --global-batch-tokens 16M
         --gemm-table "$TABLE")
  for kernels in megatron trainer; do
    echo "== 2. Llama 3 405B on 16,384 H100, $kernels kernels, linears at the measured rates"
    "$PY" -m minidist.plan "${LLAMA[@]}" --kernels "$kernels" --explain "dp=128 tp=8 pp=16 cp=1 ep=1" | tail -12
    "$PY" -m minidist.plan "${LLAMA[@]}" --kernels "$kernels" --top 12 | tail -15
  done
fi
echo "measure_gemms: done in $(( $(date +%s) - started )) s; the table: $TABLE"
