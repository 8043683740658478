"""Chapter 18's multi-process cases: minidist's pieces beside PyTorch's own (DeviceMesh, DTensor, FSDP2,
parallelize_module, pipelining, DCP), all inside ONE launch per world size.

`results(world, dcp_dir)` launches `world` gloo ranks once per test session; each rank runs every case and returns
what tests/test_native.py compares. Rank processes import this module, so it stays free of pytest.
"""

from __future__ import annotations

import copy
import functools

import dp_cases
import parity
import torch
import torch.distributed as dist

from minidist.comm.communicator import Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import GROUP_NAMES, ParallelDims, Topology
from minidist.model import build_model, lm_loss
from minidist.native import fsdp, mesh, pipelining, placements, tensor_parallel
from minidist.parallel import split_batch
from minidist.parallel.placement import placement_of
from minidist.parallel.tp.tensor import apply_tensor_parallel
from minidist.parallel.tp.vocab import vocab_parallel_cross_entropy

# Real DeviceMeshes on the launched ranks (every 8-rank layout is checked in one process with a fake backend).
MESH_LAYOUTS = {2: [ParallelDims(dp=2), ParallelDims(tp=2), ParallelDims(pp=2)],
                4: [ParallelDims(dp=2, tp=2), ParallelDims(pp=2, cp=2, ep=2), ParallelDims(dp=4, ep=2)]}
MOVES = [("S0", "R"), ("P", "R"), ("P", "S0"), ("S0", "S1"), ("R", "S0")]
SCHEDULES = ("1f1b", "interleaved", "zbv", "dualpipev")
TP_STEPS, PP_MICROBATCHES = 3, 4


def _placement(code: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial()}.get(code) or Shard(int(code[1]))


def mesh_case(layouts: list[ParallelDims]) -> list[dict]:
    """Per layout and mesh kind: (ranks, coordinate) of each mesh dimension's group, DeviceMesh's and minidist's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dims in layouts:
        topo = Topology(dims, rank, world)
        for kind, names in mesh.MESH_DIMS.items():
            dm = mesh.device_mesh(dims, kind)
            theirs = {n: (dist.get_process_group_ranks(dm.get_group(n)), dm.get_local_rank(n)) for n in names}
            ours = {n: (topo.ranks(n), topo.coord(n)) for n in names if n in GROUP_NAMES}
            back = mesh.dims_of_mesh(tuple(dm.shape), dm.mesh_dim_names)
            out.append(dict(dims=dims, kind=kind, theirs=theirs, ours=ours, back=back))
    return out


def placement_case(topo: Topology) -> dict:
    """Every parameter of a tp model as a DTensor (its full tensor, its Placement back) and every redistribute
    move under CommDebugMode: collective counts, bytes recorded vs the formula vs Comm's ledger."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    world, rank = topo.size("tp"), topo.coord("tp")
    tp_mesh = mesh.device_mesh(topo.dims)["tp"]
    full = build_model(parity.CFG, seed=parity.SEED)
    model = apply_tensor_parallel(copy.deepcopy(full), parity.CFG, topo.comm("tp"))
    wanted = dict(full.named_parameters())
    params = {}
    for name, p in model.named_parameters():
        placement = placement_of(p)
        try:
            dt = placements.dtensor_placements(placement, ("tp",))
        except ValueError as e:
            params[name] = {"refused": str(e)}
            continue
        whole = DTensor.from_local(p.detach(), tp_mesh, dt).full_tensor()
        back = placements.placement_of_dtensor(dt, ("tp",), [rank], (world,), placement.full_shape)
        params[name] = {"placements": [placements.kind(x) for x in dt], "equal": torch.equal(whole, wanted[name]),
                        "back": back.splits.get("tp") == (placement.splits["tp"] if back.splits else None)}
    x = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12) + rank  # differs by rank: partial sums matter
    moves = {}
    for src, dst in MOVES:
        local = x.chunk(world, int(src[1]))[rank] if src[0] == "S" else x
        d = DTensor.from_local(local, tp_mesh, [_placement(src)])
        recorder = placements.CollectiveShapes()
        with CommDebugMode() as counts, recorder:
            e = d.redistribute(tp_mesh, [_placement(dst)])
        op, formula = placements.redistribute_bytes(_placement(src), _placement(dst), (8, 12), 4, world, rank, "cpu")
        nccl = placements.redistribute_bytes(_placement(src), _placement(dst), (8, 12), 4, world, rank, "cuda")
        moves[f"{src}->{dst}"] = {"counts": {str(k).split(".")[-1]: v for k, v in counts.get_comm_counts().items()},
                                  "recorded": recorder.bytes_sent(rank, world), "formula": (op, formula),
                                  "nccl": nccl, "ledger": _ledger_bytes(nccl[0], x, world, rank, topo),
                                  "value": e.full_tensor() if dst != "P" else None}
    return {"params": params, "moves": moves}


def _ledger_bytes(op: str | None, x: torch.Tensor, world: int, rank: int, topo: Topology) -> int:
    """What minidist's Comm records for the same move on the same [8, 12] tensor."""
    comm = topo.comm("tp", Ledger())
    if op == "all_gather":
        comm.all_gather(x.chunk(world)[rank].contiguous())
    elif op == "all_reduce":
        comm.all_reduce(x.clone())
    elif op == "reduce_scatter":
        comm.reduce_scatter(x.clone())
    elif op == "all_to_all":  # Shard(0) -> Shard(1): the rows of my block cut by column, one piece per rank
        mine = x.chunk(world)[rank]
        comm.all_to_all(torch.cat([c.reshape(1, -1) for c in mine.chunk(world, 1)]).contiguous())
    return comm.ledger.bytes()


def fsdp_case(topo: Topology) -> dict:
    """The parity run (tests/parity.py) under FSDP2: losses, grad norms, step-0 gradients; parameter bytes and what
    is gathered as each unit's forward starts, beside minidist's ZeRO-3 run of the same steps."""
    rank, world = topo.coord("dp_cp"), topo.size("dp_cp")
    comm = topo.comm("dp_cp")
    model = build_model(parity.CFG, seed=parity.SEED)
    fsdp.fully_shard_model(model, mesh.device_mesh(topo.dims, "replicas")["dp_cp"])
    optimizer = parity.make_optimizer(model.parameters())
    units = [*model.blocks, model]
    out = {"losses": [], "norms": [], "param_bytes": fsdp.local_parameter_bytes(model)}
    for step in range(parity.STEPS):
        record, remove = fsdp.gathered_units(units, fsdp.fsdp_unit_gathered) if step == 1 else ([], lambda: None)
        (x, y), = split_batch(*parity.global_batch(step), rank, world)
        loss = lm_loss(model(x), y)
        loss.backward()
        remove()
        if step == 1:
            out["gathered"] = record
        if step == 0:
            out["grads"] = fsdp.full_gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), parity.GRAD_CLIP)
        out["norms"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(comm.all_reduce(loss.detach().clone()).item() / world)
    if rank:
        out["grads"] = None
    out["gathered_with_prefetch"] = _fsdp_prefetching(topo)
    out["zero3"] = _zero3(topo)
    return out


def mixed_precision_case(topo: Topology) -> dict:
    """Three parity steps under bf16 autocast with bf16 parameter gathers and fp32 gradient reductions: minidist's
    ZeRO-3 with that `CommPrecision`, FSDP2 with the `MixedPrecisionPolicy` `fsdp.mixed_precision_policy` makes."""
    from minidist.parallel import ZeroOptimizer
    from minidist.precision import CommPrecision

    rank, world, comm = topo.coord("dp_cp"), topo.size("dp_cp"), topo.comm("dp_cp")
    precision = CommPrecision(gather_dtype=torch.bfloat16)
    out = {}
    for side in ("zero3", "fsdp2"):
        model = build_model(parity.CFG, seed=parity.SEED)
        if side == "zero3":
            engine = ZeroOptimizer(model, parity.make_optimizer(model.parameters()), comm, 3, comm_precision=precision)
        else:
            fsdp.fully_shard_model(model, mesh.device_mesh(topo.dims, "replicas")["dp_cp"], precision)
            engine = parity.make_optimizer(model.parameters())
        out[side] = []
        for step in range(parity.STEPS):
            (x, y), = split_batch(*parity.global_batch(step), rank, world)
            with torch.autocast("cpu", torch.bfloat16):
                logits = model(x)
            loss = lm_loss(logits.float(), y)
            loss.backward()
            if side == "zero3":
                engine.clip_grad_norm(parity.GRAD_CLIP)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), parity.GRAD_CLIP)
            engine.step()
            engine.zero_grad()
            out[side].append(comm.all_reduce(loss.detach().clone()).item() / world)
    return out


def _fsdp_prefetching(topo: Topology) -> list:
    """What FSDP2 has gathered as each unit's forward starts once told to prefetch like ZeRO-3."""
    model = build_model(parity.CFG, seed=parity.SEED)
    fsdp.fully_shard_model(model, mesh.device_mesh(topo.dims, "replicas")["dp_cp"])
    fsdp.prefetch_like_zero3(model)
    record, remove = fsdp.gathered_units([*model.blocks, model], fsdp.fsdp_unit_gathered)
    (x, y), = split_batch(*parity.global_batch(0), topo.coord("dp_cp"), topo.size("dp_cp"))
    lm_loss(model(x), y).backward()
    remove()
    return record


def _zero3(topo: Topology) -> dict:
    """minidist's ZeRO-3 on the same steps (chapter 07's case), and what it gathers as each unit's forward starts."""
    result = dp_cases._train("zero", 3, 1, topo)
    model = build_model(parity.CFG, seed=parity.SEED)
    from minidist.parallel import ZeroOptimizer

    engine = ZeroOptimizer(model, parity.make_optimizer(model.parameters()), topo.comm("dp_cp"), 3)
    units = [*model.blocks, model]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}

    def unit_of(module):  # the ZeRO-3 unit gathering this module's parameters (the model: the root's)
        ids = {id(p) for p in module.parameters()} if module is not model else None
        return next(u for u in engine.params.units
                    if any((id(p) in ids) if ids is not None else (id(p) not in in_blocks) for p in u.bucket.params))

    state = {id(m): unit_of(m) for m in units}
    record, remove = fsdp.gathered_units(units, lambda m: state[id(m)].gathered or state[id(m)].pending is not None)
    (x, y), = split_batch(*parity.global_batch(0), topo.coord("dp_cp"), topo.size("dp_cp"))
    lm_loss(model(x), y).backward()
    remove()
    engine.finish_grad_sync()
    result["gathered"] = record
    return {k: result[k] for k in ("losses", "grads", "norms", "gathered", "memory")}


def tp_case(topo: Topology) -> dict:
    """Three steps of the parity model (no clipping) on one process, under minidist's tp / tp+sp and under
    parallelize_module's tp / tp+sp."""
    comm = topo.comm("tp")
    tp_mesh = mesh.device_mesh(topo.dims)["tp"]
    runs = {"single": build_model(parity.CFG, seed=parity.SEED)}
    for sp in (False, True):
        suffix = "+sp" if sp else ""
        plain = build_model(parity.CFG, seed=parity.SEED)
        runs["minidist tp" + suffix] = apply_tensor_parallel(plain, parity.CFG, comm, sequence_parallel=sp)
        runs["dtensor tp" + suffix] = tensor_parallel.parallelize(build_model(parity.CFG, seed=parity.SEED),
                                                                  tp_mesh, sequence_parallel=sp)
    losses = {}
    for name, model in runs.items():
        optimizer = parity.make_optimizer(model.parameters())
        losses[name] = []
        for step in range(TP_STEPS):
            x, y = parity.global_batch(step)
            if name.startswith("dtensor"):
                value = tensor_parallel.parallel_loss(model(x), y)
            else:
                loss = (lm_loss(model(x), y) if name == "single"
                        else vocab_parallel_cross_entropy(model(x), y, comm))
                loss.backward()
                value = loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(value)
    return losses


def pp_case(topo: Topology) -> dict:
    """One step of each schedule, minidist's executor and torch's, on the same stages: the loss, every gradient,
    and the two action lists."""
    from minidist.parallel.pp.pipeline import PipelineRunner, partition_model

    pp, rank = topo.size("pp"), topo.coord("pp")
    inputs, targets = parity.global_batch(0)
    batches = list(zip(inputs.chunk(PP_MICROBATCHES), targets.chunk(PP_MICROBATCHES)))
    out = {}
    for schedule in SCHEDULES:
        v = pipelining.CHUNKS_PER_RANK[schedule]
        stage = partition_model(build_model(parity.CFG, seed=parity.SEED), rank, pp,
                                v if schedule == "interleaved" else 1, schedule=schedule)
        stats = PipelineRunner(stage, topo.comm("pp"), schedule, PP_MICROBATCHES).step(
            batches, loss_scale=1.0 / targets.numel())
        ours = topo.comm("pp").all_reduce(stats.totals[0].detach().clone()).item() / pp / targets.numel()
        theirs_schedule, chunks = pipelining.torch_schedule(
            schedule, build_model(parity.CFG, seed=parity.SEED), stage.chunks, pp, PP_MICROBATCHES,
            topo.group("pp"), lm_loss, torch.device("cpu"))
        losses: list = []
        args = (inputs,) if 0 in stage.chunks else ()
        kwargs = {"target": targets, "losses": losses} if pp * v - 1 in stage.chunks else {}
        theirs_schedule.step(*args, **kwargs)
        total = torch.tensor([sum(x.item() for x in losses) / PP_MICROBATCHES if losses else 0.0])
        theirs = topo.comm("pp").all_reduce(total).item()
        mine = dict(stage.named_parameters())
        grads = {n.split(".", 2)[2]: (p.grad, mine[n.split(".", 2)[2]].grad) for n, p in chunks.named_parameters()}
        close = all(torch.allclose(a, b, rtol=parity.GRAD_RTOL, atol=parity.GRAD_ATOL) for a, b in grads.values())
        out[schedule] = {"ours": ours, "theirs": theirs, "grads_equal": close, "n_grads": len(grads),
                         "actions": (pipelining.minidist_actions(schedule, pp, PP_MICROBATCHES),
                                     pipelining.torch_actions(theirs_schedule.pipeline_order,
                                                             schedule in ("zbv", "dualpipev")))}
    return out


def run_all(world: int, dcp_dir: str, dcp_out: str) -> dict:
    """The rank function: every case of this world size; returns {case: result}."""
    rank = dist.get_rank()
    results = {"mesh": mesh_case(MESH_LAYOUTS[world]),
               "placement": placement_case(Topology(ParallelDims(tp=world), rank, world)),
               "fsdp": fsdp_case(Topology(ParallelDims(dp=world), rank, world))}
    if world == 2:
        results["tp"] = tp_case(Topology(ParallelDims(tp=2), rank, world))
        results["mixed"] = mixed_precision_case(Topology(ParallelDims(dp=2), rank, world))
        results["pp"] = pp_case(Topology(ParallelDims(pp=2), rank, world))
        if dcp_dir:
            import dcp_cases

            results["dcp"] = dcp_cases.fsdp_continues(Topology(ParallelDims(dp=2), rank, world), dcp_dir, dcp_out)
    return results


@functools.cache
def results(world: int, dcp_dir: str = "", dcp_out: str = "") -> list[dict]:
    """Per-rank results of `run_all(world)` (one launch per world size per test session); at world 2 with
    `dcp_dir`, the FSDP2 continuation of that DCP checkpoint, saved to `dcp_out`."""
    return run_ranks(run_all, world, world, dcp_dir, dcp_out, timeout=300, threads_per_rank=1)


def fake_backend_mesh_mismatches(dims: ParallelDims) -> list[str]:
    """Every rank of `dims` played in this process on torch's fake backend (no other process, no communication):
    DeviceMesh's group and coordinate of each mesh dimension against minidist's `group_ranks` and `coordinates`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from minidist.comm.topology import coordinates, group_ranks

    wrong = []
    for rank in range(dims.world_size):
        dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
        try:
            for kind, names in mesh.MESH_DIMS.items():
                dm = mesh.device_mesh(dims, kind)
                for name in names:
                    ours = next(g for g in group_ranks(dims, name) if rank in g), coordinates(dims, rank)[name]
                    theirs = dist.get_process_group_ranks(dm.get_group(name)), dm.get_local_rank(name)
                    if ours != theirs:
                        wrong.append(f"{dims} rank {rank} {kind} {name}: minidist {ours}, DeviceMesh {theirs}")
        finally:
            dist.destroy_process_group()
    return wrong
