"""Loss normalization is global: with ignored targets (padding, masked prompts) spread unevenly over ranks and
micro-batches, every layout's loss and gradient equal one process's mean over all counted tokens.

A mean of per-rank (or per-micro-batch) means equals that global mean only when every piece counts the same number
of tokens; here rank 0's rows are mostly padding, so a mean of means would be off by tens of percent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parity import CFG, GLOBAL_BATCH, GRAD_RTOL, SEED, assert_grads_match, global_batch, make_optimizer

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model, lm_loss
from minidist.parallel import ParallelOptions, parallelize
from minidist.parallel.placement import gather_full

LAYOUTS = [  # (label, dims, options) at world size 2
    ("dp2", ParallelDims(dp=2), ParallelOptions()),
    ("dp2 2 micro-batches", ParallelDims(dp=2), ParallelOptions(microbatches=2)),
    ("dp2 zero2", ParallelDims(dp=2), ParallelOptions(zero=2)),
    ("tp2", ParallelDims(tp=2), ParallelOptions()),
]


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's global batch with ignored targets: the first half of the rows (dp rank 0) keep 3 to 6 tokens each,
    the second half keep all but a few."""
    inputs, targets = global_batch(0)
    targets = targets.clone()
    for row in range(GLOBAL_BATCH):
        keep = 3 + row if row < GLOBAL_BATCH // 2 else targets.shape[1] - row
        targets[row, keep:] = -100
    return inputs, targets


def _one_step(label: str, dims: ParallelDims, options: ParallelOptions) -> dict:
    topo = Topology(dims, dist.get_rank(), dist.get_world_size())
    parallel = parallelize(build_model(CFG, seed=SEED), CFG, topo, options, lambda m: make_optimizer(m.parameters()))
    inputs, targets = padded_batch()
    rows = GLOBAL_BATCH // dims.dp
    mine = slice(topo.coord("dp") * rows, (topo.coord("dp") + 1) * rows)
    batches = list(zip(inputs[mine].chunk(options.microbatches), targets[mine].chunk(options.microbatches)))
    loss = parallel.forward_backward(batches).loss
    parallel.grad_pieces()  # finishes the data-parallel reduction
    if options.zero > 0:
        grads = parallel.full_gradients()
    elif dims.tp > 1:
        grads = gather_full(parallel.model, topo.comm("tp"), "tp", grads=True)
    else:
        grads = {n: p.grad.detach().clone() for n, p in parallel.model.named_parameters()}
    return {"label": label, "loss": loss, "grads": grads if topo.rank == 0 else None}


def _all_layouts() -> list[dict]:
    return [_one_step(*layout) for layout in LAYOUTS]


def test_padded_batches_match_one_process(one_thread) -> None:
    model = build_model(CFG, seed=SEED)
    inputs, targets = padded_batch()
    reference = lm_loss(model(inputs), targets)
    reference.backward()
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    per_rank = run_ranks(_all_layouts, 2, timeout=300)
    for rank_results in per_rank:
        for result in rank_results:
            assert result["loss"] == pytest.approx(reference.item(), rel=1e-6), result["label"]
    for result in per_rank[0]:
        assert_grads_match(result["grads"], want, result["label"])
    # The check has teeth: the gradient of the mean of the two ranks' own means is far from the global one.
    model.zero_grad(set_to_none=True)
    half = GLOBAL_BATCH // 2
    logits = model(inputs)
    ((lm_loss(logits[:half], targets[:half]) + lm_loss(logits[half:], targets[half:])) / 2).backward()
    wrong = model.tok_emb.weight.grad
    relative = ((wrong - want["tok_emb.weight"]).norm() / want["tok_emb.weight"].norm()).item()
    assert relative > 100 * GRAD_RTOL, f"a mean of means is only {relative:.1e} off: the padding is too even"
