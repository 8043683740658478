"""The Python half of scripts/gpu_check.sh: probes of the node and readers of the runs the script makes.

    python scripts/gpu_check.py probes DEVICE              env, sdpa and comm in one process
    python scripts/gpu_check.py env                        torch, CUDA, GPUs; the package's torch check
    python scripts/gpu_check.py sdpa DEVICE                which attention kernels run here, checked and timed
    python scripts/gpu_check.py comm DEVICE                real collectives through torch.distributed (NCCL on cuda):
                                                           world 1, or one process per GPU under torchrun
    python scripts/gpu_check.py compare REF OTHER ATOL     two runs' per-step losses agree within ATOL
    python scripts/gpu_check.py summary RUN_DIR LABEL      tokens/s, MFU and peak memory of a finished run

Each prints one line per finding and exits non-zero when a check fails.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

if sys.argv[1:2] in (["env"], ["sdpa"], ["comm"], ["probes"]):  # compare and summary read JSON: no torch import
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
    """A real collective of every kind the package uses, through torch.distributed itself (minidist's Comm makes a
    group of one rank the identity, so it would test only the initialisation). Under torchrun, one process per GPU
    (WORLD_SIZE > 1); alone, a group of one, which NCCL still runs as kernels on the GPU. Values checked on the
    host after a synchronize: each rank contributes rank + 1."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dev = torch.device(device, int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), device_id=dev if device == "cuda" else None)
    try:
        checked, bad = _collectives(dev, rank, world)
        verdict = "ok" if not bad else "WRONG " + ", ".join(bad)
        if rank == 0 or bad:
            print(f"comm {dist.get_backend()} world {world} on {device}: {verdict} (rank {rank}; "
                  f"{', '.join(checked)}, barrier: torch.distributed's own collectives)")
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


def _collectives(dev: torch.device, rank: int, world: int) -> tuple[list[str], list[str]]:
    """Each collective on `dev`: the names of those run, and of those whose result is wrong."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames the 2.11 names used here
    x = torch.full((4 * world,), float(rank + 1), device=dev)
    total = world * (world + 1) / 2
    every = torch.arange(1, world + 1, dtype=torch.float32, device=dev)
    out = {"all_reduce": x.clone(), "all_gather": torch.empty(4 * world * world, device=dev),
           "reduce_scatter": torch.empty(4, device=dev), "broadcast": x.clone(), "all_to_all": torch.empty_like(x)}
    dist.all_reduce(out["all_reduce"])
    dist.all_gather_into_tensor(out["all_gather"], x)
    dist.reduce_scatter_tensor(out["reduce_scatter"], x)
    dist.broadcast(out["broadcast"], src=0)
    dist.all_to_all_single(out["all_to_all"], x)
    want = {"all_reduce": torch.full_like(x, total), "all_gather": every.repeat_interleave(4 * world),
            "reduce_scatter": torch.full((4,), total, device=dev), "broadcast": torch.ones_like(x),
            "all_to_all": every.repeat_interleave(4)}
    if world > 1:  # a ring of point-to-point messages, posted together (NCCL's matching order)
        got = torch.empty(4, device=dev)
        ops = [dist.P2POp(dist.irecv, got, (rank - 1) % world),
               dist.P2POp(dist.isend, x[:4].clone(), (rank + 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["send/recv"], want["send/recv"] = got, torch.full((4,), float((rank - 1) % world + 1), device=dev)
    dist.barrier(device_ids=[dev.index] if dev.type == "cuda" else None)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return list(out), [op for op, y in out.items() if y.device != dev or not torch.equal(y, want[op])]


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
