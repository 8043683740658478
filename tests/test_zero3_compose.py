"""ZeRO-3 composed with tensor and pipeline parallelism, and tied embeddings across pipeline stages: every layout
logs the one-process run's losses, gradient norms and validation losses (and the replica check of the last step
finds the two tied copies bitwise equal). Beside the trainer runs, on the same
ranks: a pipeline stage's ZeRO-3 units are its own layers and a step gathers nothing else; the end-of-run gathering
holds one unit at a time; the replica check still compares the slices of tp-replicated weights under ZeRO-3.
One launch of 4 ranks runs every case."""

import functools
import weakref

import pytest
import torch
import torch.distributed as dist
import trainer_parity

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model
from minidist.parallel import ParallelOptions, parallelize
from minidist.parallel.pp.pipeline import chunk_layers
from minidist.train.config import TrainConfig, model_config
from minidist.train.optim import build_optimizer
from minidist.trust import health
from minidist.trust.replicas import ReplicasDiffer, check_replicas, replica_comms

# n_heads 4 and n_kv_heads 2 split over tp 2; 4 layers split over pp 2 (x 2 virtual stages) or pp 4.
MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}

LAYOUTS = {
    "tp2 dp2 zero3": dict(tp=2, dp=2, zero=3),
    "tp2 sp dp2 zero3": dict(tp=2, sp=True, dp=2, zero=3),
    "pp2 dp2 zero3 1f1b": dict(pp=2, dp=2, zero=3, schedule="1f1b"),
    "pp2 dp2 zero3 interleaved": dict(pp=2, dp=2, zero=3, schedule="interleaved", virtual_stages=2),
    "pp2 tp2 zero3 afab": dict(pp=2, tp=2, zero=3, schedule="afab"),
}
# Tied embeddings with pp: the first and last stage each hold a copy and sum their gradients. Plain dp, ZeRO-1/2
# (the tied weight in a bucket of its own on both stages), ZeRO-3 with tp (a unit of its own), and middle stages.
TIED = dict(MODEL, tie_embeddings=True)
TIED_LAYOUTS = {
    "tied pp2 dp2": dict(pp=2, dp=2),
    "tied pp2 dp2 zero1": dict(pp=2, dp=2, zero=1),
    "tied pp2 dp2 zero2 interleaved": dict(pp=2, dp=2, zero=2, schedule="interleaved", virtual_stages=2),
    "tied pp2 tp2 sp zero3": dict(pp=2, tp=2, sp=True, zero=3),
    "tied pp4 1f1b": dict(pp=4, schedule="1f1b"),
}


def config(out: str, **changes) -> TrainConfig:
    """3 steps of batch 8 x 32 with clipping active and 2 evaluations (steps 2 and 3)."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=100_000, batch_size=8, seq_len=32,
                    microbatches=2, steps=3, warmup_steps=1, grad_clip=1.0, eval_every=2, eval_batches=2,
                    log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def _build(dims: ParallelDims, **changes):
    """The trainer's model and `parallelize` for `config`'s settings, without the loop; and a batch per replica."""
    cfg = config("unused", **changes)
    mcfg = model_config(cfg)
    topo = Topology(dims, dist.get_rank(), dist.get_world_size())
    model = build_model(mcfg, seed=cfg.seed)
    options = ParallelOptions(sequence_parallel=cfg.sp, schedule=cfg.schedule, microbatches=cfg.microbatches,
                              virtual_stages=cfg.virtual_stages, zero=cfg.zero)
    parallel = parallelize(model, mcfg, topo, options,
                           functools.partial(build_optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay))
    tokens = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    rows = tokens.chunk(dims.dp)[topo.coord("dp")]
    batches = list(zip(rows[:, :-1].chunk(cfg.microbatches), rows[:, 1:].chunk(cfg.microbatches)))
    return parallel, topo, batches


def _stage_gathers(root: str) -> dict:
    """pp2 dp2 ZeRO-3 interleaved, 8 layers: the units of each stage, and the parameter names gathered in a step."""
    parallel, topo, batches = _build(ParallelDims(dp=2, pp=2), pp=2, dp=2, zero=3, schedule="interleaved",
                                     virtual_stages=2, model_overrides=dict(MODEL, n_layers=8))
    home = parallel.optimizer.params  # under ZeRO the optimizer is the ZeroOptimizer
    units = [sorted(u.bucket.names) for u in home.units]
    gathered: list[str] = []
    start_gather = home._start_gather

    def spy(unit) -> None:
        if not unit.gathered and unit.pending is None:
            gathered.extend(unit.bucket.names)
        start_gather(unit)

    home._start_gather = spy
    parallel.forward_backward(batches)
    parallel.clip_grad_norm_(1.0)
    parallel.step()
    return {"units": units, "gathered": sorted(set(gathered)), "peak": parallel.optimizer.peak_transient_bytes(),
            "unit_bytes": [u.full.numel() * u.full.element_size() for u in home.units],
            "pp": topo.coord("pp")}


def _final_gather(root: str) -> dict:
    """dp4 ZeRO-3: the end-of-run hash of the full parameters, and the most gathered bytes alive at once."""
    parallel, _, _ = _build(ParallelDims(dp=4), dp=4, zero=3)
    comm, live, peak = parallel.optimizer.params.comm, [0], [0]
    all_gather = comm.all_gather

    def counting(tensor, *args, **kwargs):
        out = all_gather(tensor, *args, **kwargs)
        live[0] += out.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(out, lambda n=out.nbytes: live.__setitem__(0, live[0] - n))
        return out

    comm.all_gather = counting
    digest = health.replica_hash(parallel.full_parameters())
    unit_bytes = [u.full.numel() * u.full.element_size() for u in parallel.optimizer.params.units]
    reference = build_model(model_config(config("unused")), seed=0)  # what ZeRO-3 sharded: the initial weights
    return {"hash": digest, "want": health.replica_hash(reference.parameters()), "peak": peak[0],
            "unit_bytes": unit_bytes}


def _replica_check(root: str) -> dict:
    """tp2 dp2 ZeRO-3: the replica check passes, then fails after one bit of a tp-replicated slice flips on one
    rank (rank 1: tp 1 of the first dp replica)."""
    parallel, topo, batches = _build(ParallelDims(dp=2, tp=2), tp=2, dp=2, zero=3)
    parallel.forward_backward(batches)
    parallel.clip_grad_norm_(1.0)
    parallel.step()
    comms = replica_comms(topo)
    pieces = parallel.param_pieces()
    check_replicas(parallel.model, comms, True, "clean", pieces)
    # the first tp-replicated parameter with elements in this rank's slice: the same on both ranks of a tp group
    replicated = [n for n, p in sorted(parallel.model.named_parameters())
                  if p.placement.splits["tp"].dim is None and pieces[n].numel() > 0]
    if dist.get_rank() == 1:
        pieces[replicated[0]].view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 3)
    try:
        check_replicas(parallel.model, comms, True, "flipped", pieces)
        error = None
    except ReplicasDiffer as e:
        error = str(e)
    return {"flipped": replicated[0], "error": error}


def _rank_layouts(root: str) -> dict:
    layouts = {**LAYOUTS, **{k: dict(v, model_overrides=TIED) for k, v in TIED_LAYOUTS.items()}}
    results = trainer_parity.train_layouts(root, layouts, config)  # each last step's replica check: the tied copies
    for case in (_stage_gathers, _final_gather, _replica_check):
        results[case.__name__] = case(root)
        dist.barrier()
    return results


@functools.lru_cache(maxsize=1)
def _results(root: str) -> list[dict]:
    return run_ranks(_rank_layouts, 4, root, timeout=600, threads_per_rank=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("zero3")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return trainer_parity.single_process_records(str(tmp_path_factory.mktemp("single")), config)


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory) -> list[dict]:
    return trainer_parity.single_process_records(str(tmp_path_factory.mktemp("single_tied")),
                                                 functools.partial(config, model_overrides=TIED))


@pytest.mark.parametrize("name", list(LAYOUTS) + list(TIED_LAYOUTS))
def test_layout_logs_the_single_process_run(name, results, reference, tied_reference) -> None:
    """Losses, gradient norms (the tied weight counted once) and validation losses of one process."""
    reference = tied_reference if name in TIED_LAYOUTS else reference
    trainer_parity.assert_logs_match(name, results[0][name]["records"], reference)
    for r in results:
        assert r[name]["losses"] == results[0][name]["losses"]
    assert reference[0]["grad_norm"] > 1.0  # clipping was active: a wrong norm would change the later losses


def test_pipeline_stages_gather_only_their_own_layers(results) -> None:
    layers = chunk_layers(8, 2, 2)  # chunks 0, 2 on stage 0; 1, 3 on stage 1
    for r in results:
        got = r["_stage_gathers"]
        own = [i for c in (0, 1, 2, 3) if c % 2 == got["pp"] for i in layers[c]]
        names = {n for unit in got["units"] for n in unit}
        assert {int(n.split(".")[1]) for n in names if n.startswith("blocks.")} == set(own)
        ends = {n.split(".")[0] for n in names if not n.startswith("blocks.")}
        assert ends == ({"tok_emb"} if got["pp"] == 0 else {"norm", "lm_head"})
        # a unit per block this stage holds, the embedding or the head apart from them
        assert all(len({n.split(".")[1] for n in unit if n.startswith("blocks.")}) <= 1 for unit in got["units"])
        assert set(got["gathered"]) == names  # the step gathered this stage's units, nothing else exists here
        # gathered at once: the unit in use, the next one prefetched, and one prefetched at the end of a chunk for
        # the stage's next chunk (it waits for that chunk's turn); never the whole stage
        assert got["peak"]["gathered_params"] <= sum(sorted(got["unit_bytes"])[-3:])
        assert got["peak"]["gathered_params"] < sum(got["unit_bytes"])


def test_end_of_run_gathering_holds_one_unit_at_a_time(results) -> None:
    for r in results:
        got = r["_final_gather"]
        assert got["hash"] == got["want"]  # the full parameters, in model order, bit for bit
        assert got["peak"] <= max(got["unit_bytes"]) < sum(got["unit_bytes"])


def test_zero3_replica_check_compares_tp_replicated_slices(results) -> None:
    flipped = results[0]["_replica_check"]["flipped"]
    for rank, r in enumerate(results):
        error = r["_replica_check"]["error"]
        if rank in (0, 1):  # the tp group of the flipped rank
            assert error is not None and "over tp" in error and flipped in error and "[1]" in error, error
        else:
            assert error is None
