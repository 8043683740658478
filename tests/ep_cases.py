"""Chapter 11's multi-process cases: every expert-parallel layout through `parallelize`, run inside ONE launch per
world size, and the single-device reference they must reproduce.

The reference is plain PyTorch on one process: the whole global batch (in micro-batches), the LM loss as the mean
over the global batch's tokens plus each micro-batch's MoE losses / M, global-norm clipping, AdamW, the aux-free
bias update and the step's balance figures. A layout must give the same losses, balancing losses, gradient norms,
balance figures (load imbalance, drop rate, balance and z losses), and first-step gradients assembled by name.

Rank processes import this module, so it stays free of pytest.
"""

from __future__ import annotations

import functools

import parity
import torch
import torch.distributed as dist

from minidist.comm.communicator import Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import ModelConfig, build_model, get_preset, lm_loss
from minidist.model.moe.layer import MoELayer
from minidist.model.moe.stats import moe_layers, moe_stats, update_router_biases
from minidist.parallel import ParallelOptions, parallelize
from minidist.parallel.ep.expert import ExpertParallelExperts, apply_expert_parallel, expected_ep_bytes
from minidist.parallel.placement import full_tensor, placement_of
from minidist.parallel.tp.traffic import expected_tp_traffic

# n_heads 4 and n_kv_heads 2 split over tp 2; 2 layers over pp 2; 4 experts over ep 2 or 4.
BASE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
ROUTERS = {
    # softmax top-2, dropless, balance loss and z-loss
    "softmax": dict(n_experts=4, top_k=2, d_expert=32, aux_loss_coef=0.01, z_loss_coef=1e-3),
    # softmax with a capacity factor that drops slots (per sequence)
    "softmax_cf": dict(n_experts=4, top_k=2, d_expert=32, capacity_factor=1.0, aux_loss_coef=0.01),
    # DeepSeek-V3's: sigmoid, a shared expert, the aux-free bias, capacity
    "sigmoid_bias_cf": dict(n_experts=4, top_k=2, d_expert=32, router="sigmoid", n_shared_experts=1,
                            routed_scaling_factor=2.5, bias_update_speed=0.05, capacity_factor=1.0,
                            aux_loss_coef=0.001),
}
STEPS = 3

# name -> (router, dims, zero, microbatches, sequence_parallel); dims: ParallelDims keywords
LAYOUTS: dict[int, dict[str, tuple]] = {
    2: {
        "dp2 cf (no ep)": ("softmax_cf", dict(dp=2), 0, 1, False),
        "dp2 ep2": ("softmax", dict(dp=2, ep=2), 0, 1, False),
        "dp2 ep2 cf m2": ("softmax_cf", dict(dp=2, ep=2), 0, 2, False),
        "dp2 ep2 sigmoid bias cf zero1": ("sigmoid_bias_cf", dict(dp=2, ep=2), 1, 1, False),
        "dp2 ep2 zero3 m2": ("softmax_cf", dict(dp=2, ep=2), 3, 2, False),
        "cp2 ep2 (ep from the cp ranks)": ("softmax", dict(cp=2, ep=2), 0, 1, False),  # cp: dropless only
    },
    4: {
        "dp4 ep2 sigmoid bias cf": ("sigmoid_bias_cf", dict(dp=4, ep=2), 0, 1, False),
        "dp4 ep4 zero1": ("softmax_cf", dict(dp=4, ep=4), 1, 1, False),
        "dp2 ep2 tp2 sp": ("sigmoid_bias_cf", dict(dp=2, ep=2, tp=2), 0, 1, True),
        "dp2 ep2 pp2 zero1": ("softmax_cf", dict(dp=2, ep=2, pp=2), 1, 2, False),
        "dp4 ep2 zero3": ("sigmoid_bias_cf", dict(dp=4, ep=2), 3, 1, False),
    },
}


def model_config(router: str) -> ModelConfig:
    return get_preset("tiny", **BASE, moe=ROUTERS[router])


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return parity.make_optimizer(model.parameters())


@functools.lru_cache(maxsize=8)
def reference(router: str, microbatches: int = 1, steps: int = STEPS) -> dict:
    """One process, plain PyTorch: what every layout of `router`'s model must log."""
    cfg = model_config(router)
    model = build_model(cfg, seed=parity.SEED)
    optimizer = make_optimizer(model)
    out: dict = {"losses": [], "aux": [], "norms": [], "stats": []}
    for step in range(steps):
        inputs, targets = parity.global_batch(step)
        count = (targets != -100).sum()
        loss_sum, aux_sum = 0.0, 0.0
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            loss = lm_loss(model(x), y, reduction="sum")
            aux = model.aux_loss()
            (loss / count + aux / microbatches).backward()
            loss_sum, aux_sum = loss_sum + loss.item(), aux_sum + aux.item() / microbatches
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), parity.GRAD_CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_router_biases(model)
        out["stats"].append(moe_stats(model))
        out["losses"].append(loss_sum / count.item())
        out["aux"].append(aux_sum)
    out["biases"] = torch.stack([m.router_bias for m in moe_layers(model)])
    return out


def _full_gradients(parallel, topo: Topology) -> dict[str, torch.Tensor]:
    """The first step's gradients of this rank's parameters, whole (tp and ep slices gathered), by name."""
    grads = parallel.full_gradients()
    placements = {n: placement_of(p) for n, p in parallel.model.named_parameters()}
    out = {}
    for name, grad in grads.items():
        for group in ("tp", "ep"):
            split = placements[name].splits.get(group)
            if split is not None and topo.size(group) > 1:
                grad = full_tensor(grad, split, topo.comm(group, Ledger()))
        out[name] = grad.detach().clone()
    return out


def _layout(name: str, router: str, dims: dict, zero: int, microbatches: int, sp: bool) -> dict:
    cfg = model_config(router)
    topo = Topology(ParallelDims(**dims), dist.get_rank(), dist.get_world_size())
    options = ParallelOptions(sequence_parallel=sp, microbatches=microbatches, zero=zero)
    parallel = parallelize(build_model(cfg, seed=parity.SEED), cfg, topo, options, make_optimizer)
    experts = [m.experts for m in moe_layers(parallel.model) if isinstance(m.experts, ExpertParallelExperts)]
    dp, dp_i = topo.size("dp"), topo.coord("dp")
    out: dict = {"name": name, "losses": [], "aux": [], "norms": [], "stats": [], "dims": dims}
    for step in range(STEPS):
        inputs, targets = parity.global_batch(step)
        rows = inputs.shape[0] // dp
        mine = slice(dp_i * rows, (dp_i + 1) * rows)
        batches = list(zip(inputs[mine].chunk(microbatches), targets[mine].chunk(microbatches)))
        tp_ledger = parallel.model.blocks[-1].attn.wo.comm.ledger if topo.size("tp") > 1 else Ledger()
        for ledger in [tp_ledger] + [e.comm.ledger for e in experts[:1]]:
            ledger.reset()
        losses = parallel.forward_backward(batches)
        if step == 0:
            out["tp_traffic"] = tp_ledger.totals()
            if topo.size("tp") > 1:
                out["tp_expected"] = expected_tp_traffic(cfg, rows // microbatches, inputs.shape[1], topo.size("tp"),
                                                         sp, rank=topo.coord("tp"))
            if experts and microbatches == 1:  # the dispatch bytes against the formula, from the actual counts
                quiet = topo.comm("ep", Ledger())
                matrices = [quiet.all_gather(e.last_counts.unsqueeze(0)) for e in experts]
                out["ledger"] = {"measured": experts[0].comm.ledger.bytes(group="ep"),
                                 "formula": sum(expected_ep_bytes(c, cfg.moe.n_experts, topo.coord("ep"), cfg.d_model)
                                                for c in matrices)}
            grads = _full_gradients(parallel, topo)
        out["norms"].append(float(parallel.clip_grad_norm_(parity.GRAD_CLIP)))
        parallel.step()
        out["stats"].append(parallel.moe_stats())
        out["losses"].append(losses.loss)
        out["aux"].append(losses.aux_loss)
    keep = topo.rank in (0, topo.world_size - 1)  # both ends of the grid: every stage and shard position
    out["grads"] = grads if keep else None
    out["biases"] = {m.layer_index: m.router_bias.clone() for m in moe_layers(parallel.model)}
    return out


def _starved() -> dict:
    """A router that sends every slot to rank 0's experts: rank 1 computes nothing, yet it must join every
    all-to-all of forward and backward (before: its empty expert output left the autograd graph and its peer hung
    in the backward all-to-all). Outputs and gradients against one device, in float64."""
    rank = dist.get_rank()
    topo = Topology(ParallelDims(dp=2, ep=2), rank, 2)
    layers = []
    for parallel in (False, True):
        layer = MoELayer(model_config("sigmoid_bias_cf").replace(d_model=16)).double()
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
            layer.router_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # choose experts 0 and 1 (on rank 0)
        layers.append(apply_expert_parallel(layer, topo.comm("ep")) if parallel else layer)
    x = torch.randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    comm, calls = layers[1].experts.comm, []
    plain_all_to_all = comm.all_to_all

    def recording_all_to_all(tensor, *args, **kwargs):  # what each all-to-all of forward and backward sends
        calls.append({"rows": tensor.shape[0], "in_splits": kwargs.get("in_splits"),
                      "async_op": kwargs.get("async_op", False)})
        return plain_all_to_all(tensor, *args, **kwargs)

    comm.all_to_all = recording_all_to_all
    out = {"calls": calls}
    for name, layer, inputs in (("one", layers[0], x.flatten(0, 1)), ("ep", layers[1], x[rank])):
        inputs = inputs.clone().requires_grad_()
        y = layer(inputs)
        y.square().sum().backward()
        out[name] = {"y": y.detach(), "x_grad": inputs.grad, "router": layer.router.weight.grad,
                     "experts": {n: p.grad for n, p in layer.experts.named_parameters()}}
    return out


def run_all(world: int) -> dict:
    out = {"layouts": [_layout(name, *layout) for name, layout in LAYOUTS[world].items()]}
    if world == 2:
        out["starved"] = _starved()
    return out


@functools.cache
def results(world: int) -> list[dict]:
    """Per rank: {"layouts": the results of every layout of LAYOUTS[world], in order, "starved": ...}; one launch
    per world size per test session."""
    return run_ranks(run_all, world, world, timeout=600, threads_per_rank=1)
