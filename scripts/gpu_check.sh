#!/usr/bin/env bash
# The one prepared check for a GPU node with its own CUDA torch and no network. From the checkout:
#   scripts/gpu_check.sh                      # cuda: every step timed against its budget; one GPU under 8 minutes
#   scripts/gpu_check.sh --device cpu         # the same steps, CPU-sized (tests/test_gpu_check.py runs it in CI)
#   scripts/gpu_check.sh --install            # first `pip install -e .`: the runtime dependencies only, the node's
#                                             # torch pinned (needs an index)
#   scripts/gpu_check.sh --dry-run [--gpus N] # the plan: each step, its budget and its commands, nothing run
# 1. probes: torch, CUDA, GPUs, the package's torch check; which SDPA kernels run (checked against the math kernel,
#    timed); real collectives through torch.distributed (NCCL on cuda): a group of one, and with 2+ GPUs one
#    process per GPU (minidist's Comm makes a group of one the identity, so it would test only the set-up).
# 2. parity: a tiny model, 5 steps, fp32, on the CPU and on DEVICE: the losses agree (TF32 on CUDA: 5e-3). On
#    cuda also with --doc-mask (flex attention's BlockMask on the GPU against SDPA's bool mask on the CPU), and
#    compiled (--compile, inductor) against the eager run.
# 3. throughput: configs/gpu/dense-1b.toml (0.97B, bf16): eager, compiled, eager with --recompute full, and (cuda
#    only) eager with --fp8 rowwise (tokens/s, MFU, peak memory). On --device cpu a 2-layer stand-in, eager and
#    recomputed.
# 4. layouts (2+ GPUs; on --device cpu, 2 gloo processes): the tiny model compiled under dp2 ZeRO-3, tp2+sp,
#    pp2 zbv, cp2 ring and dp2 ep2 (MoE) (with 4+ GPUs also dp2 tp2 sp and pp2 cp2 on 4), and eager under dp2 ZeRO-1, pp2 1f1b, cp2 (ring, all-gather, Ulysses)
#    with --doc-mask, with the replica check every step, each against its one-device eager run; a checkpoint round
#    trip (stop after 3 steps, resume to 5) against the straight run. CPU: the round trip only.
# Every step prints its time against its budget (seconds, one H100/H200, a cold compile cache: inductor's and
# Triton's caches start empty in OUT). Steps 1-3 are the one-GPU check: their budgets sum to at most 480 s, and a
# one-GPU run over 480 s fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
DEVICE=cuda OUT="" INSTALL=0 DRY=0 GPUS=""
usage() { echo "usage: scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--install] [--dry-run] [--gpus N]" >&2
          exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) [ $# -ge 2 ] || usage; DEVICE="$2"; shift 2 ;;
    --out) [ $# -ge 2 ] || usage; OUT="$2"; shift 2 ;;
    --gpus) [ $# -ge 2 ] || usage; GPUS="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --dry-run) DRY=1; shift ;;
    *) usage ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "error: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
case "$GPUS" in ""|[0-9]|[0-9][0-9]) ;; *) echo "error: --gpus must be a GPU count (0-99), got $GPUS" >&2; exit 2 ;; esac
if [ -n "$GPUS" ] && [ "$DRY" = 0 ]; then echo "error: --gpus is for --dry-run (a plan for N GPUs)" >&2; exit 2; fi
OUT="${OUT:-$(mktemp -d)}"
[ "$DRY" = 1 ] || mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then
  GPUS=0
elif [ -z "$GPUS" ]; then
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
fi
# A cold compile cache, the same on every run: a first run on a fresh node is what the budgets are for.
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor-cache" TRITON_CACHE_DIR="$OUT/triton-cache"
ONE_GPU_BUDGET=480
started=$(date +%s)
one_gpu_seconds=0

x() {  # x COMMAND...: run it; under --dry-run print it
  if [ "$DRY" = 1 ]; then echo "    would run: $*"; else "$@"; fi
}
step() {  # step NAME BUDGET_S FUNCTION: run a step, print its time against its budget
  local name="$1" budget="$2" t0 seconds; shift 2
  echo "== step $name (budget ${budget} s)"
  t0=$(date +%s)
  "$@"
  seconds=$(( $(date +%s) - t0 ))
  case "$name" in probes|parity|throughput) one_gpu_seconds=$(( one_gpu_seconds + seconds )) ;; esac
  if [ "$DRY" = 0 ]; then
    local verdict="within budget"
    [ "$seconds" -le "$budget" ] || verdict="OVER BUDGET"
    echo "   step $name: ${seconds} s of ${budget} s ($verdict)"
  fi
}
logged() {  # logged LOG COMMAND...: run it into LOG; on a failure show the log's tail and stop
  local log="$1"; shift
  if [ "$DRY" = 1 ]; then echo "    would run: $* > $log"; return; fi
  "$@" > "$log" 2>&1 || { echo "FAILED ($log): $*"; tail -30 "$log"; exit 1; }
}
check() { x "$PY" scripts/gpu_check.py "$@"; }
train() { "$PY" -m minidist.train "$@"; }
launch() {  # launch NPROC ARGS...: the trainer on NPROC processes of this node
  local n="$1"; shift
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" -m minidist.train "$@"
}

LAYERS=2 && [ "$DEVICE" = cuda ] && LAYERS=4  # zbv's V: 2 chunks on each of 2 pipeline ranks; a CPU keeps CI short
TINY=(--model tiny --set model.n_layers=$LAYERS --set model.d_model=64 --set model.d_ff=128 --set model.max_seq_len=64
      --max-bytes 200000 --batch-size 8 --seq-len 64 --steps 5 --warmup-steps 1 --eval-every 0 --ckpt-every 0
      --log-every 5 --no-plot --dtype fp32 --peak-flops 1e12 --no-compile)
MOE=(--set "model.moe={n_experts=4, top_k=2, capacity_factor=2.0}")
DOCS=(--doc-mask --data "$OUT/docs")  # 400 documents of 11-41 bytes: a row of 64 tokens crosses several

install() {
  local pin="torch==(the installed version)"
  [ "$DRY" = 1 ] || pin="$("$PY" -c 'import torch; print(f"torch=={torch.__version__}")')"
  # The runtime dependencies (pyproject's [project] dependencies), no extras: the trainer's, not the course's tools.
  x "$PY" -m pip install --quiet -e . -c <(echo "$pin")
}

probes() {
  check probes "$DEVICE"
  if [ "$DEVICE" = cuda ] && [ "$GPUS" -ge 2 ]; then  # one process per GPU: NCCL over the node's links
    x "$PY" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" scripts/gpu_check.py comm cuda
  fi
}

parity() {
  logged "$OUT/tiny-cpu.log" train "${TINY[@]}" --device cpu --out "$OUT/tiny-cpu" --overwrite
  logged "$OUT/tiny-device.log" train "${TINY[@]}" --device "$DEVICE" --out "$OUT/tiny-device" --overwrite
  check compare "$OUT/tiny-cpu" "$OUT/tiny-device" 5e-3
  if [ "$DEVICE" = cuda ]; then  # the document mask's GPU kernel (flex attention) against the CPU's; compiled
    x "$PY" -c 'import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(exist_ok=True)
for i in range(400): (d / f"{i:03d}.txt").write_text(f"document {i}:" + " abc" * (i % 8))' "$OUT/docs"
    logged "$OUT/tiny-docs-cpu.log" train "${TINY[@]}" "${DOCS[@]}" --device cpu --out "$OUT/tiny-docs-cpu" --overwrite
    logged "$OUT/tiny-docs-device.log" train "${TINY[@]}" "${DOCS[@]}" --device cuda --out "$OUT/tiny-docs-device" \
      --overwrite
    check compare "$OUT/tiny-docs-cpu" "$OUT/tiny-docs-device" 5e-3
    logged "$OUT/tiny-compiled.log" train "${TINY[@]}" --compile --device cuda --out "$OUT/tiny-compiled" --overwrite
    check compare "$OUT/tiny-device" "$OUT/tiny-compiled" 5e-3
  fi
}

throughput() {
  local variants big name variant
  if [ "$DEVICE" = cuda ]; then
    big=(--steps 30 --log-every 10)
    variants=("eager:--no-compile" "compiled:--compile" "recompute:--no-compile --recompute full"
              "fp8-rowwise:--no-compile --fp8 rowwise")  # FP8 GEMMs; MFU against the FP8 peak (chapter 16)
  else  # a stand-in; inductor on a 2-core CPU takes minutes (tests/test_compile.py covers --compile)
    big=(--steps 3 --log-every 1 --set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4
         --set model.n_kv_heads=2 --set model.d_ff=128 --seq-len 64 --batch-size 4 --microbatches 1
         --max-bytes 200000 --peak-flops 1e12)  # --peak-flops: no 1 s matmul measurement per run
    variants=("eager:--no-compile" "recompute:--no-compile --recompute full")
  fi
  for variant in "${variants[@]}"; do
    name="${variant%%:*}"
    # shellcheck disable=SC2086  # the variant's flags split on purpose
    logged "$OUT/dense-1b-$name.log" train --config configs/gpu/dense-1b.toml "${big[@]}" ${variant#*:} \
      --device "$DEVICE" --eval-every 0 --ckpt-every 0 --no-plot --out "$OUT/dense-1b-$name" --overwrite
    check summary "$OUT/dense-1b-$name" "dense-1b $name"
  done
}

# name:flags; " moe" and " docs" name the model and data (and the one-device run it is held against)
COMPILED=("dp2-zero3:--dp 2 --zero 3" "tp2-sp:--tp 2 --sp" "pp2-zbv:--pp 2 --schedule zbv --microbatches 4"
          "cp2-ring:--cp 2 --cp-impl ring" "ep2:--dp 2 --ep 2 moe")
COMPILED4=("dp2-tp2-sp:--dp 2 --tp 2 --sp" "pp2-cp2-ring:--pp 2 --cp 2 --microbatches 2")  # with 4+ GPUs: 4 processes
EAGER=("dp2-zero1:--dp 2 --zero 1" "pp2-1f1b:--pp 2 --microbatches 2" "cp2-ring-docs:--cp 2 --cp-impl ring docs"
       "cp2-allgather-docs:--cp 2 --cp-impl allgather docs" "cp2-ulysses-docs:--cp 2 --cp-impl ulysses docs")

layout_run() {  # layout_run NAME FLAGS COMPILE [NPROC]: one run of NPROC (2) processes, against one device's eager run
  local name="$1" flags="$2" compile="$3" nproc="${4:-2}" extra=() ref="$OUT/tiny-device"
  if [[ "$flags" == *" moe" ]]; then flags="${flags% moe}" extra=("${MOE[@]}") ref="$OUT/tiny-moe"; fi
  if [[ "$flags" == *" docs" ]]; then flags="${flags% docs}" extra=("${DOCS[@]}") ref="$OUT/tiny-docs-device"; fi
  # shellcheck disable=SC2086
  logged "$OUT/tiny-$name.log" launch "$nproc" "${TINY[@]}" "${extra[@]}" $flags $compile --check-every 1 \
    --device "$DEVICE" --out "$OUT/tiny-$name" --overwrite
  check compare "$ref" "$OUT/tiny-$name" 5e-3
}

layouts() {
  local layout
  if [ "$DEVICE" = cuda ]; then
    logged "$OUT/tiny-moe.log" train "${TINY[@]}" "${MOE[@]}" --device cuda --out "$OUT/tiny-moe" --overwrite
    for layout in "${COMPILED[@]}"; do layout_run "${layout%%:*}-compiled" "${layout#*:}" --compile; done
    if [ "$GPUS" -ge 4 ]; then
      for layout in "${COMPILED4[@]}"; do layout_run "${layout%%:*}-compiled" "${layout#*:}" --compile 4; done
    fi
    for layout in "${EAGER[@]}"; do layout_run "${layout%%:*}" "${layout#*:}" --no-compile; done
  fi
  echo "   checkpoint round trip: dp2 ZeRO-1, stop after 3 steps, resume to 5"
  local round=("${TINY[@]}" --dp 2 --zero 1 --ckpt-every 3 --check-every 1 --device "$DEVICE" --out "$OUT/tiny-resumed")
  logged "$OUT/tiny-resumed-1.log" launch 2 "${round[@]}" --stop-after 3 --overwrite
  logged "$OUT/tiny-resumed-2.log" launch 2 "${round[@]}" --resume
  if [ "$DEVICE" = cuda ]; then  # against the straight dp2 run: CUDA's atomic adds leave last-bit differences
    check compare "$OUT/tiny-dp2-zero1" "$OUT/tiny-resumed" 1e-4
  else  # against the one-process run: dp2 sums its two halves in another order
    check compare "$OUT/tiny-device" "$OUT/tiny-resumed" 1e-5
  fi
}

# Budgets: one H100/H200, cold caches. 1-3 sum to 470 s of the 480 s one-GPU limit.
[ "$INSTALL" = 1 ] && step install 180 install
step probes 40 probes
step parity 110 parity
step throughput 320 throughput
if [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
  step layouts 900 layouts
else
  echo "== step layouts: skipped ($GPUS GPU(s) visible; needs 2 or more)"
fi
[ "$DRY" = 1 ] && { echo "gpu_check: plan for $DEVICE with $GPUS GPU(s), nothing run"; exit 0; }
total=$(( $(date +%s) - started ))
if [ "$DEVICE" = cuda ] && [ "$one_gpu_seconds" -gt "$ONE_GPU_BUDGET" ]; then
  echo "gpu_check: FAILED: the one-GPU steps took ${one_gpu_seconds} s, over ${ONE_GPU_BUDGET} s ($OUT)"
  exit 1
fi
echo "gpu_check: all checks passed in $total s (one-GPU steps ${one_gpu_seconds} s) ($OUT)"
