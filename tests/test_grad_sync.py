"""`ParallelModel`'s engines behind one interface (minidist/parallel/grad_sync.py): on one process, every ZeRO stage
answers the same questions (which elements' optimizer state this rank holds, which optimizers, which tensors)."""

from __future__ import annotations

import pytest
import torch

from minidist.comm.topology import ParallelDims, Topology
from minidist.memory import storage_bytes
from minidist.model import build_model, get_preset
from minidist.parallel import ParallelModel, ParallelOptions, parallelize
from minidist.parallel.dp.data_parallel import DataParallel
from minidist.parallel.dp.zero import ZeroOptimizer
from minidist.parallel.ep.expert_grads import ExpertReplicas
from minidist.parallel.grad_sync import GradSync, SingleReplica
from minidist.train.optim import build_optimizer

CFG = get_preset("tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)


def _stepped(zero: int) -> ParallelModel:
    model = build_model(CFG, seed=0)
    parallel = parallelize(model, CFG, Topology(ParallelDims(), 0, 1), ParallelOptions(zero=zero),
                           lambda m: build_optimizer(m, lr=1e-3, weight_decay=0.1))
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    parallel.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    parallel.clip_grad_norm_(1.0)
    parallel.step()
    parallel.forward_backward([(tokens[:, :-1], tokens[:, 1:])])  # the gradients of a second step exist
    parallel.finish_grad_sync()
    return parallel


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_stage_answers_the_same_questions(zero: int):
    parallel = _stepped(zero)
    numel = {n: p.numel() for n, p in build_model(CFG, seed=0).named_parameters()}
    # one process owns every element of every parameter, each exactly once, and its optimizer holds their state
    owned: dict[str, int] = {}
    for r in parallel.owned_ranges():
        if r.sharded_over is not None or zero == 0:
            owned[r.name] = owned.get(r.name, 0) + r.stop - r.start
            assert r.optimizer in parallel.optimizers() and set(r.optimizer.state[r.key]) >= {"exp_avg", "step"}
    assert owned == numel
    assert parallel.params_sharded == (zero == 3)
    assert sum(t.numel() for t in parallel.param_pieces().values()) == sum(numel.values())
    held = parallel.held_tensors()
    assert storage_bytes(held["params"]) >= 4 * sum(numel.values())
    assert storage_bytes(held["grads"]) >= 4 * sum(numel.values())  # one rank's gradient shard is the whole
    assert parallel.reduction_bytes() == 0  # one replica sends nothing
    # the whole model, whatever holds it
    full = dict(zip(numel, parallel.full_parameters()))
    assert {n: t.numel() for n, t in full.items()} == numel


def test_every_engine_is_a_grad_sync():
    assert all(issubclass(engine, GradSync) for engine in (SingleReplica, DataParallel, ZeroOptimizer, ExpertReplicas))
