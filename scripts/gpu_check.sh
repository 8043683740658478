#!/usr/bin/env bash
# One prepared check for a GPU machine that has a CUDA torch and no network. From the checkout, no install:
#   scripts/gpu_check.sh                 # cuda: ~3-6 minutes on one H100
#   scripts/gpu_check.sh --device cpu    # the same steps, CPU-sized (tests/test_gpu_check.py runs it)
# 1. parity: a tiny model, 5 steps, fp32, on the CPU and on DEVICE: the losses agree (TF32 on CUDA: 5e-3).
# 2. throughput: 30 steps of configs/gpu/dense-1b.toml (0.97B, bf16 on CUDA): tokens/s, MFU, peak memory.
#    On --device cpu a 2-layer stand-in of the same config runs 3 steps, so the path cannot rot.
# 3. only with >= 2 visible GPUs: dp2, tp2 and pp2 runs of the tiny model match its one-process losses.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
DEVICE=cuda
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "usage: scripts/gpu_check.sh [--device cuda|cpu] [--out DIR]" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "error: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '|', torch.cuda.device_count(), 'GPU(s)', *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"

TINY=(--model tiny --set model.n_layers=2 --set model.d_model=64 --set model.d_ff=128 --set model.max_seq_len=64
      --max-bytes 200000 --batch-size 8 --seq-len 64 --steps 5 --warmup-steps 1 --eval-every 0 --ckpt-every 0
      --log-every 5 --no-plot --dtype fp32 --peak-flops 1e12)

compare() {  # compare REFERENCE_DIR OTHER_DIR ATOL: the per-step losses of two runs agree within ATOL
  "$PY" - "$@" <<'PYEOF'
import json, sys
ref, other, atol = sys.argv[1], sys.argv[2], float(sys.argv[3])
def losses(d):
    return [json.loads(line)["loss"] for line in open(f"{d}/metrics.jsonl")]
a, b = losses(ref), losses(other)
gap = max(abs(x - y) for x, y in zip(a, b))
ok = len(a) == len(b) and gap <= atol
print(f"parity {'ok' if ok else 'FAILED'}: {other} vs {ref}: max |loss gap| {gap:.2e} (tolerance {atol:g})")
sys.exit(0 if ok else 1)
PYEOF
}

echo "== 1. parity: tiny model, cpu vs $DEVICE"
"$PY" -m minidist.train "${TINY[@]}" --device cpu --out "$OUT/tiny-cpu" --overwrite > "$OUT/tiny-cpu.log"
"$PY" -m minidist.train "${TINY[@]}" --device "$DEVICE" --out "$OUT/tiny-device" --overwrite > "$OUT/tiny-device.log"
compare "$OUT/tiny-cpu" "$OUT/tiny-device" 5e-3

echo "== 2. throughput: configs/gpu/dense-1b.toml"
if [ "$DEVICE" = cuda ]; then
  BIG=(--steps 30 --log-every 5)
else
  BIG=(--steps 3 --log-every 1 --set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4
       --set model.n_kv_heads=2 --set model.d_ff=128 --seq-len 64 --batch-size 4 --microbatches 1 --max-bytes 200000)
fi
"$PY" -m minidist.train --config configs/gpu/dense-1b.toml "${BIG[@]}" --device "$DEVICE" --eval-every 0 \
  --ckpt-every 0 --no-plot --out "$OUT/dense-1b" --overwrite
"$PY" - "$OUT/dense-1b" <<'PYEOF'
import json, sys
run = json.load(open(f"{sys.argv[1]}/run.json"))
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
final = run["final"]
print(f"dense-1b: {run['params'] / 1e9:.3g}B params, {run['dtype']}, {final['mean_tokens_per_s']:,.0f} tokens/s, "
      f"MFU {final['cumulative_mfu']:.1%} (peak {final['final_peak_flops'] / 1e12:.3g} TFLOP/s: "
      f"{run['peak_flops_source']}), peak memory {max(rows[-1]['peak_mem_bytes']) / 2**30:.2f} GiB")
PYEOF

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -ge 2 ]; then
  echo "== 3. parallel parity on 2 of $GPUS GPUs: dp2, tp2, pp2 vs one GPU"
  for layout in "--dp 2" "--tp 2" "--pp 2 --microbatches 2"; do
    name="$(echo "$layout" | tr -d ' -')"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m minidist.train "${TINY[@]}" $layout \
      --device cuda --out "$OUT/tiny-$name" --overwrite > "$OUT/tiny-$name.log"
    compare "$OUT/tiny-device" "$OUT/tiny-$name" 5e-3
  done
else
  echo "== 3. parallel parity: skipped ($GPUS GPU(s) visible; needs --device cuda and >= 2)"
fi
echo "gpu_check: all checks passed ($OUT)"
