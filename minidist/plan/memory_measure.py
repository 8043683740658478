"""What a rank really holds, measured by tensor accounting, to check the memory model (`rank_memory`) against.

A CPU has no allocator counter like `torch.cuda.memory_allocated`, and its resident set size is dominated by the
interpreter and torch itself, so the bytes are counted from the tensors:

* model states: the distinct storages of the parameters, the gradients (a data-parallel bucket or a ZeRO shard once,
  however many views of it there are) and the optimizer's state, after one optimizer step (so the moments exist)
  and a second forward and backward (so the gradients do);
* activations: `memory.PeakSavedBytes` around the second step's forward and backward: the most bytes saved for the
  backward alive at once, over all the micro-batches a schedule keeps in flight. Not under `--recompute selective`:
  the outputs its policy keeps live in the checkpoint's cache, which autograd's saved-tensor hooks never see
  (tests/test_recompute.py measures them in one process with `memory.LiveTensorBytes` instead).

`measure_layouts` is a rank function for `minidist.comm.launch.run_ranks`: every rank runs every case (a labelled
`Layout`) and returns its own figures with its grid coordinates.
"""

from __future__ import annotations

import torch

from minidist.comm.topology import Topology
from minidist.memory import PeakSavedBytes, storage_bytes
from minidist.model import ModelConfig, build_model
from minidist.parallel import Layout, ParallelModel, parallelize
from minidist.parallel.dp.data_parallel import split_batch
from minidist.train.blocks import apply_recompute
from minidist.train.optim import build_optimizer


def measure_model_states(parallel: ParallelModel) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (distinct storages; not the optimizer's 0-d
    step counters, 4 bytes per parameter tensor, which the memory model leaves out)."""
    held = parallel.held_tensors()
    states = [v for opt in parallel.optimizers() for s in opt.state.values() for k, v in s.items()
              if isinstance(v, torch.Tensor) and k != "step"]
    return {"params": storage_bytes(held["params"]), "grads": storage_bytes(held["grads"]),
            "optimizer": storage_bytes(states)}


def random_batch(cfg: ModelConfig, seq_len: int, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets) every case of a measurement trains on: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, cfg.vocab_size, (global_batch, seq_len), generator=generator)
    return inputs, torch.randint(0, cfg.vocab_size, (global_batch, seq_len), generator=generator)


def build_case(cfg: ModelConfig, layout: Layout, data: tuple[torch.Tensor, torch.Tensor], seed: int
               ) -> tuple[ParallelModel, Topology, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """`layout` on this rank: (the parallelized model, its topology, this rank's micro-batches of `data`, the
    model's buffers)."""
    topo = Topology.from_env(layout.dims)
    model = build_model(cfg, seed=seed)
    if layout.recompute != "none":
        apply_recompute(model, layout.recompute)
    buffers = list(model.buffers())
    parallel = parallelize(model, cfg, topo, layout.options, lambda m: build_optimizer(m, lr=1e-3, weight_decay=0.1))
    batches = split_batch(*data, topo.coord("dp"), layout.dims.dp, layout.options.microbatches)
    return parallel, topo, batches, buffers


def measure_layouts(cfg: ModelConfig, cases: dict[str, Layout], seq_len: int, global_batch: int,
                    seed: int = 0) -> list[dict]:
    """Rank function: for each case {label: layout}, build the layout, take one step and measure the next; return
    this rank's bytes by part (params, grads, optimizer, activations) with its label and coordinates (pp, tp, dp,
    cp, ep) per case, in the cases' order."""
    data = random_batch(cfg, seq_len, global_batch, seed)
    results = []
    for label, layout in cases.items():
        parallel, topo, batches, buffers = build_case(cfg, layout, data, seed)
        parallel.forward_backward(batches)
        parallel.clip_grad_norm_(0.0)
        parallel.step()
        with PeakSavedBytes(params=list(parallel.model.parameters()), exclude=buffers) as saved:
            parallel.forward_backward(batches)
        parallel.grad_pieces()  # the gradient reduction finished: shards and buckets hold their final bytes
        out = measure_model_states(parallel)
        out["activations"] = saved.peak
        out.update(label=label, coords={n: topo.coord(n) for n in ("pp", "dp", "cp", "tp", "ep")})
        results.append(out)
        topo.comm("world").barrier()  # the next case builds new groups: every rank is done with this one
    return results
