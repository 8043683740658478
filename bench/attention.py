"""Chapter 19's Triton FlashAttention-2 (minidist.kernels) against PyTorch's SDPA with its FlashAttention backend, on
a GPU: forward and forward + backward, bf16, causal, by sequence length and head size.

    .venv/bin/python bench/attention.py [--batch 4] [--heads 16] [--kv-heads 16] [--seqs 1024,2048,4096]
                                        [--head-dims 64,128] [--repeats 20] [--warmup 5]

Before timing, each shape's outputs and gradients must agree with SDPA's (bf16: 2e-2 of the largest value). Time:
CUDA events around `--repeats` calls after `--warmup`, the median reported; FLOPs are the forward's 4·B·H·S²·d,
halved by the causal mask, and 3.5 forwards for forward + backward (the backward recomputes the scores: 2.5
forwards), FlashAttention's own benchmark convention. Last line: JSON, per shape the kernel's and SDPA's TFLOP/s.

On a CPU nothing here would measure a kernel: the Triton kernel runs only under Triton's interpreter there (numpy,
one program after another), so the script says so and exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args()


def timed(fn, repeats: int, warmup: int) -> float:
    """Median seconds of fn() over `repeats` calls, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if k.shape[1] != q.shape[1]:  # the flash backend takes equal head counts: repeated inside the timed call
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def check_equal(kernel, q, k, v) -> None:
    """Outputs and gradients of the kernel against SDPA's, before anything is timed."""
    outs, grads = [], []
    for fn in (kernel, sdpa_flash):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        outs.append(out.float())
        grads.append([t.grad.float() for t in leaves])
    for name, a, b in [("out", *outs), *zip(("dq", "dk", "dv"), *grads)]:
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        if err > 2e-2:
            raise SystemExit(f"{name} differs from SDPA's by {err:.2e} of its largest value: nothing timed")


def bench_shape(args, seq: int, d: int) -> dict:
    from minidist.kernels.flash import flash_attention

    shape = (args.batch, args.heads, seq, d)
    kv_shape = (args.batch, args.kv_heads, seq, d)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    kernel = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    check_equal(kernel, q, k, v)
    flops = 4 * args.batch * args.heads * seq * seq * d / 2
    row = {"seq": seq, "head_dim": d}
    for name, fn in (("triton", kernel), ("sdpa_flash", sdpa_flash)):
        out = fn(q, k, v)
        grad = torch.ones_like(out)
        fwd = timed(lambda fn=fn: fn(q, k, v), args.repeats, args.warmup)
        both = timed(lambda fn=fn, grad=grad: fn(q, k, v).backward(grad), args.repeats, args.warmup)
        row[name] = {"fwd_tflops": flops / fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / both / 1e12}
    print(f"S={seq:6} d={d:3}: triton fwd {row['triton']['fwd_tflops']:6.1f} fwd+bwd "
          f"{row['triton']['fwd_bwd_tflops']:6.1f} TFLOP/s | SDPA flash fwd {row['sdpa_flash']['fwd_tflops']:6.1f} "
          f"fwd+bwd {row['sdpa_flash']['fwd_bwd_tflops']:6.1f}")
    return row


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        print("bench/attention.py measures GPU kernels; there is no GPU here, and on a CPU the Triton kernel runs "
              "only under Triton's interpreter (numpy), so this measures nothing")
        return
    from minidist import kernels

    why = kernels.unavailable("cuda")
    if why:
        sys.exit(why)
    import minidist.kernels.flash  # noqa: F401  (decorates the kernels: compiled, or interpreted if asked)

    if kernels.interpreted():
        sys.exit("TRITON_INTERPRET is set: the kernels would run in the interpreter, not on the GPU; unset it")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, heads {args.heads}/"
          f"{args.kv_heads}, bf16, causal")
    rows = [bench_shape(args, int(s), int(d)) for d in args.head_dims.split(",") for s in args.seqs.split(",")]
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
