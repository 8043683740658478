#!/usr/bin/env bash
# The one prepared check for a GPU node with its own CUDA torch and no network. From the checkout:
#   scripts/gpu_check.sh                      # cuda: under 8 minutes on one H200 (figures: README, "On GPUs")
#   scripts/gpu_check.sh --device cpu         # the same steps, CPU-sized (tests/test_gpu_check.py runs it in CI)
#   scripts/gpu_check.sh --install            # first `pip install -e .` with the node's torch pinned (needs an index)
# 0. env: torch, CUDA, GPUs; the package's torch check (every torch.distributed name it calls exists here).
# 1. probes: which SDPA kernels run (flash / cuDNN on sm90), checked against the math kernel and timed; a world-1
#    process group (NCCL on cuda) through minidist's Comm.
# 2. parity: a tiny model, 5 steps, fp32, on the CPU and on DEVICE: the losses agree (TF32 on CUDA: 5e-3). On
#    cuda also with --doc-mask: flex attention's BlockMask on the GPU against SDPA's bool mask on the CPU.
# 3. throughput: configs/gpu/dense-1b.toml (0.97B, bf16): eager, compiled, eager with --recompute full, and (cuda
#    only) eager with --fp8 rowwise (tokens/s, MFU, peak memory). On --device cpu a 2-layer stand-in of the same config, eager and recomputed.
# 4. layouts (2+ GPUs; on --device cpu, 2 gloo processes): the tiny model under dp (ZeRO 1 and 3), tp+sp, pp,
#    cp (ring, all-gather, Ulysses also with --doc-mask) and ep (an MoE variant) with the replica check every step, each
#    against its one-device run, and a checkpoint round trip (stop after 3 steps, resume to 5) against the straight
#    run. CPU: the round trip only.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
DEVICE=cuda
OUT=""
INSTALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--install]" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "error: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
CHECK=("$PY" scripts/gpu_check.py)
started=$(date +%s)

if [ "$INSTALL" = 1 ]; then
  echo "== install: the package and its extras, the node's torch kept (a pip constraint on its version)"
  TORCH_PIN="$("$PY" -c 'import torch; print(f"torch=={torch.__version__}")')"
  "$PY" -m pip install --quiet -e ".[dev]" -c <(echo "$TORCH_PIN")
fi

echo "== 0-1. env and probes: torch, attention kernels, a world-1 process group on $DEVICE"
"${CHECK[@]}" probes "$DEVICE"

TINY=(--model tiny --set model.n_layers=2 --set model.d_model=64 --set model.d_ff=128 --set model.max_seq_len=64
      --max-bytes 200000 --batch-size 8 --seq-len 64 --steps 5 --warmup-steps 1 --eval-every 0 --ckpt-every 0
      --log-every 5 --no-plot --dtype fp32 --peak-flops 1e12)
logged() {  # logged LOG COMMAND...: run it into LOG; on a failure show the log's tail and stop
  local log="$1"; shift
  "$@" > "$log" 2>&1 || { echo "FAILED ($log): $*"; tail -30 "$log"; exit 1; }
}
train() { "$PY" -m minidist.train "$@"; }
launch() {  # launch NPROC ARGS...: the trainer on NPROC processes of this node
  local n="$1"; shift
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" -m minidist.train "$@"
}

echo "== 2. parity: tiny model, cpu vs $DEVICE"
logged "$OUT/tiny-cpu.log" train "${TINY[@]}" --device cpu --out "$OUT/tiny-cpu" --overwrite
logged "$OUT/tiny-device.log" train "${TINY[@]}" --device "$DEVICE" --out "$OUT/tiny-device" --overwrite
"${CHECK[@]}" compare "$OUT/tiny-cpu" "$OUT/tiny-device" 5e-3
DOCS=(--doc-mask --data "$OUT/docs")  # 400 documents of 11-41 bytes: a row of 64 tokens crosses several
if [ "$DEVICE" = cuda ]; then  # the document mask's GPU kernel (flex attention) against the CPU's
  "$PY" -c 'import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(exist_ok=True)
for i in range(400): (d / f"{i:03d}.txt").write_text(f"document {i}:" + " abc" * (i % 8))' "$OUT/docs"
  logged "$OUT/tiny-docs-cpu.log" train "${TINY[@]}" "${DOCS[@]}" --device cpu --out "$OUT/tiny-docs-cpu" --overwrite
  logged "$OUT/tiny-docs-device.log" train "${TINY[@]}" "${DOCS[@]}" --device cuda --out "$OUT/tiny-docs-device" \
    --overwrite
  "${CHECK[@]}" compare "$OUT/tiny-docs-cpu" "$OUT/tiny-docs-device" 5e-3
fi

echo "== 3. throughput: configs/gpu/dense-1b.toml"
if [ "$DEVICE" = cuda ]; then
  BIG=(--steps 30 --log-every 10)
  VARIANTS=("eager:--no-compile" "compiled:--compile" "recompute:--no-compile --recompute full"
            "fp8-rowwise:--no-compile --fp8 rowwise")  # FP8 GEMMs; MFU against the FP8 peak (chapter 16)
else  # a stand-in; inductor on a 2-core CPU takes minutes (tests/test_compile.py covers --compile)
  BIG=(--steps 3 --log-every 1 --set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4
       --set model.n_kv_heads=2 --set model.d_ff=128 --seq-len 64 --batch-size 4 --microbatches 1 --max-bytes 200000)
  BIG+=(--peak-flops 1e12)  # no 1 s matmul measurement per run
  VARIANTS=("eager:--no-compile" "recompute:--no-compile --recompute full")
fi
for variant in "${VARIANTS[@]}"; do
  name="${variant%%:*}"
  # shellcheck disable=SC2086  # the variant's flags split on purpose
  logged "$OUT/dense-1b-$name.log" train --config configs/gpu/dense-1b.toml "${BIG[@]}" ${variant#*:} \
    --device "$DEVICE" --eval-every 0 --ckpt-every 0 --no-plot --out "$OUT/dense-1b-$name" --overwrite
  "${CHECK[@]}" summary "$OUT/dense-1b-$name" "dense-1b $name"
done

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
MOE=(--set "model.moe={n_experts=4, top_k=2, capacity_factor=2.0}")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -ge 2 ]; then
  LAYOUTS=("dp2-zero1:--dp 2 --zero 1" "dp2-zero3:--dp 2 --zero 3" "tp2-sp:--tp 2 --sp"
           "pp2-1f1b:--pp 2 --microbatches 2" "cp2-ring:--cp 2 --cp-impl ring" "ep2:--ep 2 moe"
           "cp2-ring-docs:--cp 2 --cp-impl ring docs" "cp2-allgather-docs:--cp 2 --cp-impl allgather docs"
           "cp2-ulysses-docs:--cp 2 --cp-impl ulysses docs")
else  # on a CPU only the round trip below (its first launch is a dp2 run): each launch costs seconds in CI
  LAYOUTS=()
fi
if [ "$DEVICE" = cuda ] && [ "$GPUS" -lt 2 ]; then
  echo "== 4. layouts: skipped ($GPUS GPU(s) visible; needs 2 or more)"
else
  echo "== 4. layouts on 2 processes ($DEVICE), replica check every step, against one device"
fi
if [ "${#LAYOUTS[@]}" -gt 0 ]; then
  logged "$OUT/tiny-moe.log" train "${TINY[@]}" "${MOE[@]}" --device "$DEVICE" --out "$OUT/tiny-moe" --overwrite
  for layout in "${LAYOUTS[@]}"; do
    name="${layout%%:*}" flags="${layout#*:}" extra=() ref="$OUT/tiny-device"
    if [[ "$flags" == *" moe" ]]; then flags="${flags% moe}" extra=("${MOE[@]}") ref="$OUT/tiny-moe"; fi
    if [[ "$flags" == *" docs" ]]; then flags="${flags% docs}" extra=("${DOCS[@]}") ref="$OUT/tiny-docs-device"; fi
    # shellcheck disable=SC2086
    logged "$OUT/tiny-$name.log" launch 2 "${TINY[@]}" "${extra[@]}" $flags --check-every 1 --device "$DEVICE" \
      --out "$OUT/tiny-$name" --overwrite
    "${CHECK[@]}" compare "$ref" "$OUT/tiny-$name" 5e-3
  done
fi
if [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
  echo "   checkpoint round trip: dp2 ZeRO-1, stop after 3 steps, resume to 5"
  ROUND=("${TINY[@]}" --dp 2 --zero 1 --ckpt-every 3 --check-every 1 --device "$DEVICE" --out "$OUT/tiny-resumed")
  logged "$OUT/tiny-resumed-1.log" launch 2 "${ROUND[@]}" --stop-after 3 --overwrite
  logged "$OUT/tiny-resumed-2.log" launch 2 "${ROUND[@]}" --resume
  if [ "$DEVICE" = cuda ]; then  # against the straight dp2 run: CUDA's atomic adds leave last-bit differences
    "${CHECK[@]}" compare "$OUT/tiny-dp2-zero1" "$OUT/tiny-resumed" 1e-4
  else  # against the one-process run: dp2 sums its two halves in another order
    "${CHECK[@]}" compare "$OUT/tiny-device" "$OUT/tiny-resumed" 1e-5
  fi
fi
echo "gpu_check: all checks passed in $(( $(date +%s) - started )) s ($OUT)"
