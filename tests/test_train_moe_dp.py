"""MoE with auxiliary-loss-free router biases under data parallelism: the replicas must stay identical.

Each replica counts the expert loads of its own rows; unless those counts are summed over the data-parallel group
before the sign update, the router biases (buffers, outside the gradient) of the replicas drift apart.
"""

import torch.distributed as dist

from minidist.launch import run_ranks
from minidist.train import parse_config, train


def _moe_run(out_dir: str) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = parse_config([
        "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.d_ff=128",
        "--set", "model.moe={n_experts=4, top_k=2, bias_update_speed=0.05, router='sigmoid'}",
        "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--max-bytes", "200000",
        "--eval-every", "0", "--ckpt-every", "0", "--no-plot", "--dp", str(world), "--out", f"{out_dir}/dp{world}",
    ])
    summary = train(cfg)
    return {"losses": summary["losses"], "param_hash": summary["param_hash"]}


def test_router_biases_stay_in_sync_across_replicas(tmp_path) -> None:
    single = _moe_run(str(tmp_path))
    ranks = run_ranks(_moe_run, 2, str(tmp_path), timeout=240)
    assert ranks[0]["param_hash"] == ranks[1]["param_hash"], "data-parallel replicas diverged"
    for got, want in zip(ranks[0]["losses"], single["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), (ranks[0]["losses"], single["losses"])
