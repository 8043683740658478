"""The Python half of scripts/gpu_check.sh: probes of the node and readers of the runs the script makes.

    python scripts/gpu_check.py probes DEVICE              env, sdpa and comm in one process
    python scripts/gpu_check.py env                        torch, CUDA, GPUs; the package's torch check
    python scripts/gpu_check.py sdpa DEVICE                which attention kernels run here, checked and timed
    python scripts/gpu_check.py comm DEVICE                a world-1 process group (NCCL on cuda) through Comm
    python scripts/gpu_check.py compare REF OTHER ATOL     two runs' per-step losses agree within ATOL
    python scripts/gpu_check.py summary RUN_DIR LABEL      tokens/s, MFU and peak memory of a finished run

Each prints one line per finding and exits non-zero when a check fails.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import time
from pathlib import Path

if sys.argv[1:2] in (["env"], ["sdpa"], ["comm"], ["probes"]):  # compare and summary read JSON: no torch import
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minidist.comm.communicator import Comm
    from minidist.comm.torch_support import check_torch


def env() -> int:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"torch {torch.__version__} | cuda {torch.version.cuda} available {torch.cuda.is_available()} | "
          f"{len(names)} GPU(s) {', '.join(names)}")
    if torch.cuda.is_available():
        print(f"compute capability {torch.cuda.get_device_capability()} | NCCL {torch.cuda.nccl.version()}")
    check_torch()  # the node's own torch: old enough for every name the package calls
    print("torch check ok: every torch.distributed name the package calls exists here")
    return 0


def sdpa(device: str) -> int:
    """Causal attention of a 1B model's shape through each SDPA backend: does it run, does it match the math
    backend, how long does forward + backward take."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, h, t, d = (4, 32, 2048, 64) if device == "cuda" else (1, 4, 128, 32)
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    fused = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                seconds = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                                device)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        except RuntimeError as e:
            print(f"sdpa {backend.name:<20} unavailable: {str(e).splitlines()[0][:100]}")
            continue
        error = (out.float() - reference).abs().max().item()
        ok = error < (2e-2 if dtype == torch.bfloat16 else 1e-4)
        print(f"sdpa {backend.name:<20} {'ok' if ok else 'WRONG'}: fwd+bwd {seconds * 1e3:.2f} ms, "
              f"max |error| vs math {error:.1e} ({dtype}, {b}x{h}x{t}x{d} causal)")
        if not ok:
            return 1
        if backend != SDPBackend.MATH:
            fused.append(backend.name)
    if device == "cuda" and not fused:
        print("sdpa FAILED: no fused attention kernel runs on this GPU")
        return 1
    return 0


def _time(fn, device: str, reps: int = 5) -> float:
    fn()  # warm-up: kernel selection, workspace allocation
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def comm(device: str) -> int:
    """A process group of one (NCCL on cuda, gloo on cpu) and every collective kind the package uses, through Comm:
    the backend initialises, takes this device's tensors and returns the right values."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=dev if device == "cuda" else None)
    try:
        c = Comm(name="world", expect_device=dev)
        x = torch.arange(8, dtype=torch.float32, device=dev)
        results = {"all_reduce": c.all_reduce(x.clone()), "all_gather": c.all_gather(x),
                   "reduce_scatter": c.reduce_scatter(x), "all_to_all": c.all_to_all(x),
                   "broadcast": c.broadcast(x.clone())}
        c.barrier(dev)
        bad = [op for op, y in results.items() if y.device != dev or not torch.equal(y, x)]
        print(f"comm {dist.get_backend()} world 1 on {dev}: {'ok' if not bad else 'WRONG ' + ', '.join(bad)} "
              f"({', '.join(results)}, barrier)")
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


def probes(device: str) -> int:
    return env() or sdpa(device) or comm(device)


def compare(ref: str, other: str, atol: str) -> int:
    a, b = _losses(ref), _losses(other)
    gap = max((abs(x - y) for x, y in zip(a, b)), default=float("inf"))
    ok = len(a) == len(b) > 0 and gap <= float(atol)
    print(f"parity {'ok' if ok else 'FAILED'}: {other} vs {ref}: {len(b)} steps, max |loss gap| {gap:.2e} "
          f"(tolerance {float(atol):g})")
    return 0 if ok else 1


def _losses(run: str) -> list[float]:
    return [json.loads(line)["loss"] for line in Path(run, "metrics.jsonl").read_text().splitlines()]


def summary(run: str, label: str) -> int:
    info = json.loads(Path(run, "run.json").read_text())
    rows = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    final = info["final"]
    memory = max(max(r["peak_mem_bytes"]) for r in rows if "peak_mem_bytes" in r)
    print(f"{label}: {info['params'] / 1e9:.3g}B params, {info['dtype']}, {final['mean_tokens_per_s']:,.0f} tokens/s, "
          f"MFU {final['cumulative_mfu']:.1%} (peak {final['final_peak_flops'] / 1e12:.3g} TFLOP/s: "
          f"{info['peak_flops_source']}), peak memory {memory / 2**30:.2f} GiB")
    return 0


COMMANDS = {"probes": probes, "env": env, "sdpa": sdpa, "comm": comm, "compare": compare, "summary": summary}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python scripts/gpu_check.py {{{'|'.join(COMMANDS)}}} ARGS...")
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
