"""Memory that scales, in the trainer: `setup` builds each rank's model on the meta device and fills only what the
rank keeps, so a tp2 rank and a pp2 rank never hold more than their parameters plus one full parameter in transit
(tensor accounting over the whole of `setup`: corpus, model, optimizer, validation batches). Building the full
model first, as the trainer used to, would peak above the whole model's bytes."""

import math

import pytest

from minidist.comm.bootstrap import DistEnv, init_distributed, pick_device
from minidist.comm.launch import run_ranks
from minidist.flops import count_params
from minidist.memory import LiveTensorBytes
from minidist.parallel.placement import placement_of
from minidist.train import loop as train
from minidist.train.config import TrainConfig, check_config
from minidist.train.preflight import resolve_layout

# d 256, 4 layers: 3.3M parameters (13.1 MB fp32); the largest is a 256 x 768 MLP matrix (0.79 MB).
MODEL = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, max_seq_len=64)


def _setup_bytes(root: str, layout: dict) -> dict:
    cfg = TrainConfig(model="tiny", model_overrides=dict(MODEL), max_bytes=20_000, batch_size=4, seq_len=32,
                            steps=1, eval_batches=1, out=f"{root}/{'_'.join(map(str, layout.values()))}",
                            peak_flops=1e12, plot=False, **layout)
    mcfg = check_config(cfg)
    env = DistEnv.detect()
    device = pick_device("cpu", env)
    parallel_layout = resolve_layout(cfg, env.world_size)
    topo, _ = init_distributed(parallel_layout.dims, env, device)
    with LiveTensorBytes() as memory:
        run = train.setup(cfg, parallel_layout, env, topo, device)
        kept = memory.current  # everything setup leaves alive: the parameters, the corpus, validation batches
    params = list(run.parallel.model.parameters())
    largest = max(math.prod(placement_of(p).full_shape) for p in params) * 4
    return {"peak": memory.peak, "kept": kept, "largest_full": largest, "full_model": count_params(mcfg) * 4,
            "local": sum(p.numel() * p.element_size() for p in params), "meta": any(p.is_meta for p in params)}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2, microbatches=2)], ids=["tp2", "pp2"])
def test_trainer_rank_holds_its_part_plus_one_parameter(tmp_path, layout):
    results = run_ranks(_setup_bytes, 2, str(tmp_path), layout, timeout=300, threads_per_rank=1)
    for rank, r in enumerate(results):
        assert not r["meta"], f"rank {rank}: a parameter was left on the meta device"
        assert r["local"] < 0.6 * r["full_model"], f"rank {rank} holds {r['local']} of {r['full_model']} bytes"
        # At most one full parameter in transit above what setup leaves alive (which holds this rank's part).
        assert r["peak"] <= r["kept"] + r["largest_full"], f"rank {rank}: {r}"
        assert r["peak"] < 0.75 * r["full_model"], f"rank {rank}: {r}"  # the full model never was
