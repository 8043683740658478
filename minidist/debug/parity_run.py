"""A small run through the real assembly (`parallelize` → `ParallelModel`) and everything a parity check compares.

The bug museum and the tolerance lab of chapter 14 both need the same experiment: train a tiny model for a few
steps under some layout, and bring back what the one-process run is compared with: the loss and the gradient norm
of every step, the first step's full gradients and the initial full parameters by name (gathered from tp shards,
collected from pipeline stages), the contribution of every parameter to the gradient norm as the layout computed
it, the replica check's verdict after the last step and the bytes the data-parallel reduction sent.

`run(setup)` runs one `Setup` on its ranks (`minidist.comm.launch.run_ranks`) and merges them; `run_local(setup)` runs a
one-rank setup in this process (the reference). `run_rank(setups)` is the rank function: one launch can run many
setups of the same world size (each builds its own groups), which is what keeps the tests fast.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minidist.comm.communicator import Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import Topology
from minidist.data.corpus import load_corpus
from minidist.data.sampler import BatchSampler
from minidist.debug import grad_diff, museum
from minidist.model import ModelConfig, build_model, get_preset
from minidist.parallel import Layout, parallelize
from minidist.parallel.assembly import IGNORE_INDEX
from minidist.parallel.dp.data_parallel import split_batch
from minidist.precision import autocast_for
from minidist.train.optim import build_optimizer
from minidist.trust.replicas import ReplicasDiffer, check_replicas, replica_comms

# Small enough for 2 CPU ranks in a second; every layout of the lab divides it (2 layers for pp 2, 4 heads and
# 2 kv heads for tp 2, 8 rows for dp 4 x 2 micro-batches).
CFG: ModelConfig = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
SEQ_LEN, GLOBAL_BATCH, SEED = 32, 8, 1234
LR, GRAD_CLIP = 3e-3, 0.5  # the clip is below the first steps' norms (~2): a wrong norm changes the update
LAB_SETTINGS = ("dp", "tp", "pp", "microbatches")  # what a Setup's layout may change


@dataclass(frozen=True)
class Setup:
    """One experiment: a layout (dp, tp, pp and micro-batches: `check_setup`), a precision, a number of steps and
    optionally a museum bug switched on."""

    layout: Layout = field(default_factory=Layout)
    steps: int = 1
    dtype: str = "fp32"  # or "bf16": autocast of the forward, fp32 weights, gradients and reductions
    reverse: bool = False  # accumulate this rank's micro-batches in reversed order
    bug: str | None = None  # a name of `museum.BUGS`
    label: str = field(default="", compare=False)

    @property
    def world(self) -> int:
        return self.layout.world_size


@functools.lru_cache(maxsize=1)
def _tokens() -> torch.Tensor:
    return load_corpus(max_bytes=300_000).train


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of `step`, the same on every rank. The first (5·row mod 13) targets of each row are
    ignored (a masked prompt), so replicas and micro-batches count different numbers of tokens."""
    inputs, targets = BatchSampler(_tokens(), SEQ_LEN, GLOBAL_BATCH, SEED).batch(step)
    targets = targets.clone()
    for row in range(targets.shape[0]):
        targets[row, : (5 * row) % 13] = IGNORE_INDEX
    return inputs, targets


def local_batches(step: int, topo: Topology, setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the global batch of `step` (a contiguous block per dp rank), in micro-batches."""
    batches = split_batch(*global_batch(step), topo.coord("dp"), topo.size("dp"), setup.layout.options.microbatches)
    return batches[::-1] if setup.reverse else batches


def _train(setup: Setup, topo: Topology) -> dict:
    torch.manual_seed(SEED)
    model = build_model(CFG, seed=SEED)
    names = [name for name, _ in model.named_parameters()]
    make_optimizer = functools.partial(build_optimizer, lr=LR, weight_decay=0.1)
    parallel = parallelize(model, CFG, topo, setup.layout.options, make_optimizer)
    quiet = topo.comm("tp", Ledger()) if topo.size("tp") > 1 else None  # checking gathers stay off any ledger
    out: dict = {"rank": topo.rank, "coords": dict(topo.coords), "losses": [], "norms": [],
                 "params0": grad_diff.full_named(parallel.model, quiet)}
    autocast = autocast_for(setup.dtype, torch.device("cpu"))
    for step in range(setup.steps):
        losses = parallel.forward_backward(local_batches(step, topo, setup), autocast)
        if step == 0:
            out["contributions"] = grad_diff.norm_contributions(parallel, names)
            out["grads"] = grad_diff.full_named(parallel.model, quiet, grads=True)
        out["norms"].append(float(parallel.clip_grad_norm_(GRAD_CLIP)))
        parallel.step()
        out["losses"].append(losses.loss)
    try:  # the trainer's replica check (chapter 13), after the last step
        check_replicas(parallel.model, replica_comms(topo))
        out["replica_error"] = None
    except ReplicasDiffer as e:
        out["replica_error"] = str(e)
    # what the data-parallel all-reduce sent (the lab's layouts have no ZeRO, cp or ep: the replicas are dp's)
    out["dp_bytes"] = parallel.reduction_bytes("all_reduce") if topo.size("dp") > 1 else None
    out["numel"] = sum(t.numel() for t in out["params0"].values()) if topo.rank == 0 else None
    return out


def run_setup(setup: Setup, topo: Topology) -> dict:
    """Train `setup` on this rank (the bug, if any, switched on for the whole run)."""
    with museum.bug(setup.bug) if setup.bug else contextlib.nullcontext():
        return _train(setup, topo)


def run_rank(setups: list[Setup]) -> list[dict]:
    """Rank function: every setup in turn on this rank (all of them need the launch's world size)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return [run_setup(s, Topology(s.layout.dims, rank, world)) for s in setups]


def merge(ranks: list[dict]) -> dict:
    """One record from the ranks' records (in rank order): losses and norms as rank 0 saw them, and per name the
    tensors of the first rank that holds it (dp rank 0 of its stage, gathered over tp)."""
    first = ranks[0]
    merged = {key: first[key] for key in ("losses", "norms", "contributions", "replica_error", "dp_bytes")}
    merged["norms_by_rank"] = [r["norms"] for r in ranks]
    for key in ("grads", "params0"):
        merged[key] = {}
        for r in ranks:
            for name, tensor in r[key].items():
                merged[key].setdefault(name, tensor)
    merged["numel"] = sum(t.numel() for t in merged["params0"].values())
    return merged


def check_setup(setup: Setup) -> None:
    """Refuse, in one line and before any process starts, a setup this experiment cannot run."""
    dims, microbatches = setup.layout.dims, setup.layout.options.microbatches
    others = [key for key in setup.layout.changes() if key not in LAB_SETTINGS]
    if others:  # what the records assume: the replicas are dp's, the shards tp's, the stages pp's
        raise ValueError(f"{setup.layout}: the lab varies {', '.join(LAB_SETTINGS)} only, not {', '.join(others)}")
    if min(microbatches, setup.steps) < 1:
        raise ValueError(f"{setup}: microbatches and steps must be >= 1")
    if GLOBAL_BATCH % (dims.dp * microbatches):
        raise ValueError(f"dp={dims.dp} x microbatches={microbatches} does not divide the global batch of "
                         f"{GLOBAL_BATCH} rows; use a product among 1, 2, 4, 8")
    if CFG.n_kv_heads % dims.tp or CFG.n_layers % dims.pp:
        raise ValueError(f"tp={dims.tp} must divide {CFG.n_kv_heads} kv heads and pp={dims.pp} the "
                         f"{CFG.n_layers} layers of the lab's model; use tp and pp in 1, 2")
    if setup.dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype {setup.dtype!r} is not one of fp32, bf16")
    if setup.bug is not None and setup.bug not in museum.BUGS:
        raise ValueError(f"unknown bug {setup.bug!r}; the museum has {', '.join(museum.BUGS)}")


def run_many(setups: list[Setup], timeout: float = 180.0) -> list[dict]:
    """Run setups of one world size in one launch; one merged record per setup."""
    for setup in setups:
        check_setup(setup)
    worlds = {s.world for s in setups}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs setups of one world size, got sizes {sorted(worlds)}")
    world = worlds.pop()
    if world == 1:
        return [run_local(s) for s in setups]
    per_rank = run_ranks(run_rank, world, setups, timeout=timeout, threads_per_rank=1,
                         case=", ".join(s.label or repr(s) for s in setups))
    return [merge([per_rank[r][i] for r in range(world)]) for i in range(len(setups))]


def run(setup: Setup, timeout: float = 180.0) -> dict:
    return run_many([setup], timeout)[0]


def run_local(setup: Setup = Setup()) -> dict:
    """A one-rank setup in this process, without a process group (the reference of every comparison)."""
    if setup.world != 1:
        raise ValueError(f"run_local runs one rank; {setup} needs {setup.world}")
    check_setup(setup)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a launch: the same kernels, the same rounding
    try:
        return merge([run_setup(setup, Topology(setup.layout.dims, 0, 1))])
    finally:
        torch.set_num_threads(threads)
