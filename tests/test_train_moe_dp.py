"""MoE through the trainer under data and expert parallelism: every layout logs the one-process run.

Each replica counts the expert loads of its own rows; unless those counts are summed over the data-parallel group
before the sign update, the router biases (buffers, outside the gradient) of the replicas drift apart. With
--ep 2 the experts are split over the two ranks (tokens travel by all-to-all), and the logged losses and balance
figures (load imbalance, drop rate, balance and z losses: sums over the global batch) must not change, nor after a
resume of the expert-parallel run from its step-2 checkpoint (each rank saved its own block of experts).
"""

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from minidist.comm.launch import run_ranks
from minidist.train import checkpoint
from minidist.train.config import parse_config
from minidist.train.loop import train

FIGURES = ("loss", "aux_loss", "grad_norm", "moe_load_imbalance", "moe_max_load_imbalance", "moe_drop_rate",
           "moe_balance_loss", "moe_z_loss", "val_loss")


def _moe_run(out_dir: str, ep: int = 1, zero: int = 0, resume: bool = False) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = f"{out_dir}/dp{world}_ep{ep}_zero{zero}"
    cfg = parse_config([
        "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.d_ff=128",
        "--set", "model.moe={n_experts=4, top_k=2, bias_update_speed=0.05, router='sigmoid', capacity_factor=1.0}",
        "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--max-bytes", "200000", "--microbatches", "2",
        "--eval-every", "0", "--ckpt-every", "2" if ep > 1 else "0", "--no-plot", "--dp", str(world), "--ep", str(ep),
        "--zero", str(zero), "--out", out, *(["--resume"] if resume else []),
    ])
    summary = train(cfg)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written metrics.jsonl
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"records": records, "param_hash": summary["param_hash"], "resumed_from": summary["resumed_from"]}


def _layouts(out_dir: str) -> dict:
    runs = {"dp2": _moe_run(out_dir), "dp2 ep2 zero1": _moe_run(out_dir, ep=2, zero=1)}
    if dist.get_rank() == 0:  # pretend the expert-parallel run died after its step-2 checkpoint
        ckpts = Path(out_dir) / "dp2_ep2_zero1" / "checkpoints"
        shutil.rmtree(ckpts / checkpoint.step_dir_name(4))
        (ckpts / checkpoint.LATEST).write_text(checkpoint.step_dir_name(2) + "\n")
    dist.barrier()
    runs["dp2 ep2 zero1, resumed at step 2"] = _moe_run(out_dir, ep=2, zero=1, resume=True)
    return runs


def test_moe_layouts_log_the_one_process_run(tmp_path) -> None:
    single = _moe_run(str(tmp_path))["records"]
    assert min(r["moe_drop_rate"] for r in single) > 0  # the capacity factor drops slots
    assert "val_loss" in single[-1]  # the last step evaluates: an expert-parallel forward without backward
    ranks = run_ranks(_layouts, 2, str(tmp_path), timeout=300, threads_per_rank=1)
    assert ranks[0]["dp2"]["param_hash"] == ranks[1]["dp2"]["param_hash"], "data-parallel replicas diverged"
    assert ranks[0]["dp2 ep2 zero1, resumed at step 2"]["resumed_from"] == 2
    for name, got in ranks[0].items():
        for g, w in zip(got["records"], single, strict=True):
            bad = {k: (g.get(k), w[k]) for k in FIGURES if k in w and abs(g[k] - w[k]) > 1e-6 + 1e-5 * abs(w[k])}
            assert not bad, f"{name}, step {w['step']}: {bad}"
