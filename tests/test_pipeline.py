"""Pipeline parallelism (chapter 09): schedules, simulator, partition, and parity with the single-device run.

The schedule tests need no process group: they check each schedule's lists against its definition and the
simulator's bubble against the published formulas. The parity tests run every layout of one world size in ONE
launch (`_results`, cached for the session) and compare each with tests/parity.py: the loss of every step, and the
first step's gradient gathered from the stages by parameter name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import parity
import pytest
import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model, lm_loss
from minidist.parallel.placement import clip_grad_norm_, placement_of
from minidist.parallel.pp.nccl_model import SEND, Op, Post
from minidist.parallel.pp.p2p import InFlight, Message
from minidist.parallel.pp.pipeline import PipelineRunner, chunk_layers, partition_model, validate_pipeline
from minidist.parallel.pp.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    Action,
    B,
    F,
    bubble_formula,
    build_schedule,
    check_complete,
    forward_only,
    rank_chunks,
    simulate,
    with_communication,
)

CFG8 = parity.CFG.replace(n_layers=8)  # pp=4 with 2 virtual stages needs 8 layers
IGNORE = -100  # lm_loss's ignore_index


def _counted(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Target tokens the loss counts in these micro-batches (0-d float64)."""
    return sum((targets != IGNORE).sum() for _, targets in batches).double()


def _pieces(stage: torch.nn.Module) -> list:
    return [(p.grad, placement_of(p)) for p in stage.parameters() if p.grad is not None]


# ---------------------------------------------------------------------------------------------------------------
# Schedules as data, and the simulator
# ---------------------------------------------------------------------------------------------------------------

GRID = [(s, p, m, v) for s in SCHEDULES for p in range(1, 6) for m in range(1, 13)
        for v in ((1, 2, 3, 4) if s == "interleaved" else (1,)) if not (s == "interleaved" and m < p)]


def test_every_schedule_is_complete_and_runs_without_deadlock() -> None:
    for schedule, p, m, v in GRID:
        actions = build_schedule(schedule, p, m, v)
        check_complete(actions, p, m, v)
        simulate(actions)  # raises on a deadlock or on a compute action that runs before its input arrived
        evaluation = simulate(forward_only(p, m, v))
        assert sorted(e.action for e in evaluation.events if e.action.kind == F) == sorted(
            Action(F, i, c) for i in range(m) for c in range(p * v))


@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_simulated_bubble_equals_the_formula_exactly(t_f: float, t_b: float) -> None:
    # t_f, t_b are per micro-batch per rank; a rank with v chunks spends t/v on each.
    for schedule, p, m, v in GRID:
        timeline = simulate(build_schedule(schedule, p, m, v), t_f / v, t_b / v)
        want = (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)
        assert timeline.bubble_fraction() == pytest.approx(want, abs=1e-12), (schedule, p, m, v)
        assert timeline.makespan == pytest.approx((m + (p - 1) / v) * (t_f + t_b), rel=1e-12)
        assert bubble_formula(schedule, p, m, v) == pytest.approx(want, abs=1e-15)


def test_communication_cost_lengthens_the_critical_path() -> None:
    # AFAB with p=4, m=4 and latency c: the first backward of rank 0 waits for 3 forward and 3 backward messages.
    timeline = simulate(build_schedule("afab", 4, 4), 1.0, 2.0, comm=0.5)
    assert timeline.makespan == pytest.approx((4 + 3) * 3.0 + 2 * 3 * 0.5)


def _in_flight(order: list[Action]) -> int:
    live = peak = 0
    for a in order:
        live += (a.kind == F) - (a.kind == B)
        peak = max(peak, live)
    return peak


def test_1f1b_holds_at_most_p_minus_r_microbatches_and_afab_holds_all() -> None:
    for p in range(1, 6):
        for m in range(1, 10):
            for r in range(p):
                assert _in_flight(build_schedule("afab", p, m)[r]) == m
                assert _in_flight(build_schedule("1f1b", p, m)[r]) == min(p - r, m)


def test_a_deadlocking_schedule_is_caught() -> None:
    # Both ranks start with a backward whose gradient nobody has produced yet.
    orders = [[Action(B, 0, 0), Action(F, 0, 0)], [Action(B, 0, 1), Action(F, 0, 1)]]
    with pytest.raises(ValueError, match="before its forward|deadlocks"):
        simulate(with_communication(orders, 2))
    swapped = build_schedule("1f1b", 2, 2)
    swapped[1] = [a for a in swapped[1] if a.kind != "RECV_F"] + [Action("RECV_F", 0, 1)]
    with pytest.raises(ValueError, match="input was received"):
        simulate(swapped)


# ---------------------------------------------------------------------------------------------------------------
# Validation and partition
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(pp=5, microbatches=5), "fewer than the 5 pipeline chunks"),
    (dict(pp=2, microbatches=4, virtual_stages=3, schedule="interleaved", cfg=CFG8), "virtual_stages=3 does not"),
    (dict(pp=2, microbatches=4, virtual_stages=4, schedule="interleaved"), "fewer than the 8 pipeline chunks"),
    (dict(pp=4, microbatches=2, virtual_stages=1, schedule="interleaved"), "needs microbatches >= pp"),
    (dict(pp=2, microbatches=2, virtual_stages=2, schedule="1f1b"), "needs schedule='interleaved'"),
    (dict(pp=2, microbatches=2, schedule="zb"), "unknown pipeline schedule"),
    (dict(pp=2, microbatches=3, batch_size=8), "does not split into microbatches=3"),
    (dict(pp=0, microbatches=2), "pp must be a positive integer"),
])
def test_bad_layouts_give_one_line_errors(kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=match) as info:
        validate_pipeline(kwargs.pop("cfg", parity.CFG), **kwargs)
    assert "\n" not in str(info.value)


def test_tied_embeddings_leave_a_copy_on_the_first_and_last_stage() -> None:
    """The last stage keeps the tied weight under its one-process name (so it draws the same initial value and
    counts as an embedding for weight decay); the first holds the embedding, the middle stages neither."""
    cfg = parity.CFG.replace(tie_embeddings=True, n_layers=4)
    validate_pipeline(cfg, 4, 4)
    stages = [partition_model(build_model(cfg, seed=0), r, 4) for r in range(4)]
    whole = build_model(cfg, seed=0).tok_emb.weight
    for r, stage in enumerate(stages):
        names = dict(stage.named_parameters())
        assert ("tok_emb.weight" in names) == (r in (0, 3)) and "lm_head.weight" not in names
        if r in (0, 3):
            assert torch.equal(names["tok_emb.weight"], whole)
    assert stages[3].lm_head.weight is stages[3].tok_emb.weight and stages[0].lm_head is None


def test_layers_split_evenly_and_in_order() -> None:
    assert chunk_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(c) for c in chunk_layers(7, 3)] == [3, 2, 2]
    for n in range(1, 13):
        for k in range(1, n + 1):
            chunks = chunk_layers(n, k)
            assert [i for c in chunks for i in c] == list(range(n))
            assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_stages_keep_the_plain_model_names_and_values(pp: int, v: int) -> None:
    plain = dict(build_model(CFG8, seed=parity.SEED).named_parameters())
    seen: list[str] = []
    for r in range(pp):
        stage = partition_model(build_model(CFG8, seed=parity.SEED), r, pp, v)
        for name, param in stage.named_parameters():
            assert torch.equal(param, plain[name]), name
            assert placement_of(param).stage == r, name  # what the gradient norm and checkpoints read
            seen.append(name)
        assert len(stage.blocks) == CFG8.n_layers  # other stages' blocks are holes, not renumbered
        assert ("tok_emb.weight" in dict(stage.named_parameters())) == (r == 0)
        assert ("lm_head.weight" in dict(stage.named_parameters())) == (r == pp - 1)
    assert sorted(seen) == sorted(plain)  # every parameter on exactly one stage


@pytest.mark.parametrize("schedule,m,v", [("afab", 4, 1), ("interleaved", 2, 4)])
def test_one_rank_with_virtual_stages_matches_the_reference(schedule: str, m: int, v: int) -> None:
    # pp=1 needs no process group: chunks on the same rank hand their activations over locally.
    reference = parity.reference_run()
    stage = partition_model(build_model(parity.CFG, seed=parity.SEED), 0, 1, v)
    runner = PipelineRunner(stage, Comm(), schedule, m)
    optimizer = parity.make_optimizer(stage.parameters())
    losses = []
    for step in range(parity.STEPS):
        inputs, targets = parity.global_batch(step)
        batches = list(zip(inputs.chunk(m), targets.chunk(m)))
        count = _counted(batches)
        losses.append(runner.step(batches, loss_scale=1 / count).loss / count.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        clip_grad_norm_(_pieces(stage), parity.GRAD_CLIP, {})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    parity.assert_losses_match(losses, reference["losses"], f"pp1 {schedule} v={v}")
    parity.assert_grads_match(grads, reference["grads"], f"pp1 {schedule} v={v}")


# ---------------------------------------------------------------------------------------------------------------
# Multi-process parity: one launch per world size runs every case
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    m: int
    v: int = 1
    dp: int = 1
    tp: int = 1
    layers: int = 4
    batch: int = parity.GLOBAL_BATCH
    data: str = "none"  # "ddp" (overlapped bucketed all-reduce) or "zero1" when dp > 1
    sp: bool = False  # sequence parallel (with tp)
    tied: bool = False  # tied embeddings: only under zbv here, whose rank 0 holds both uses (no copies to sum)

    @property
    def name(self) -> str:
        extra = (f" dp{self.dp}-{self.data}" if self.dp > 1 else "") + (f" tp{self.tp}" if self.tp > 1 else "")
        extra += (" sp" if self.sp else "") + (" tied" if self.tied else "")
        return f"pp{self.pp} {self.schedule} m={self.m} v={self.v} batch={self.batch}{extra}"


# m = pp, 2·pp, and one m that is not a multiple of pp (m < pp for AFAB/1F1B; 3 and 6 with a batch of 12 for
# interleaved, which needs m >= pp).
CASES = {
    2: [Case(s, 2, m) for s in ("afab", "1f1b") for m in (2, 4, 1)]
    + [Case("interleaved", 2, 2, 2), Case("interleaved", 2, 4, 2), Case("interleaved", 2, 3, 2, batch=12)]
    # chapter 15: zb1 needs m >= p, zbv m >= 2p
    + [Case("zb1", 2, 2), Case("zb1", 2, 4), Case("zbv", 2, 4), Case("zbv", 2, 4, tied=True), Case("dualpipev", 2, 4)],
    4: [Case(s, 4, m) for s in ("afab", "1f1b") for m in (4, 8, 2)]
    + [Case("interleaved", 4, 4, 2, layers=8), Case("interleaved", 4, 8, 2, layers=8),
       Case("interleaved", 4, 6, 2, layers=8, batch=12)]
    + [Case("1f1b", 2, 2, dp=2, data="ddp"), Case("interleaved", 2, 2, 2, dp=2, data="ddp"),
       Case("afab", 2, 2, dp=2, data="zero1")]
    + [Case("1f1b", 2, 2, tp=2), Case("interleaved", 2, 2, 2, tp=2, sp=True)]
    + [Case("zb1", 4, 4), Case("zbv", 4, 8, layers=8), Case("zbv", 2, 4, dp=2, data="ddp"),
       Case("zb1", 2, 2, tp=2, sp=True), Case("dualpipev", 4, 8, layers=8)],
}


def _run_case(case: Case, topo: Topology) -> dict:
    from minidist.parallel import DataParallel, ZeroOptimizer, split_batch
    from minidist.parallel.placement import gather_full
    from minidist.parallel.tp.tensor import apply_tensor_parallel
    from minidist.parallel.tp.vocab import vocab_parallel_cross_entropy

    ledger = Ledger()
    pp_comm, dp_comm, tp_comm = topo.comm("pp", ledger), topo.comm("dp_cp", Ledger()), topo.comm("tp", Ledger())
    cfg = (CFG8 if case.layers == 8 else parity.CFG).replace(tie_embeddings=case.tied)
    model = build_model(cfg, seed=parity.SEED)
    loss_fn, shape = functools.partial(lm_loss, reduction="sum"), None  # the runner wants Σ token losses
    if case.tp > 1:
        apply_tensor_parallel(model, cfg, tp_comm, sequence_parallel=case.sp)
        loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=tp_comm, reduction="sum")
        if case.sp:  # hidden states between stages are this rank's slice of the sequence
            shape = lambda tokens: (tokens.shape[0], tokens.shape[1] // case.tp, cfg.d_model)  # noqa: E731
    stage = partition_model(model, topo.coord("pp"), case.pp, case.v, loss_fn=loss_fn, schedule=case.schedule)
    runner = PipelineRunner(stage, pp_comm, case.schedule, case.m, case.v, activation_shape=shape,
                            measure_memory=True)
    optimizer = parity.make_optimizer(stage.parameters())
    engine = None
    if case.data == "ddp":
        engine = DataParallel(stage, dp_comm)
    elif case.data == "zero1":
        engine = optimizer = ZeroOptimizer(stage, optimizer, dp_comm, 1)
    out: dict = {"losses": [], "grads": {}, "coords": dict(topo.coords)}
    # Evaluation (forwards only, any number of micro-batches) at the initial weights = the reference's first loss.
    # Losses are sums of token losses: summed over the data-parallel replicas, divided by the global count.
    inputs, targets = parity.global_batch(0, case.batch)
    eval_sum = torch.tensor(runner.evaluate(split_batch(inputs, targets, topo.coord("dp"), case.dp, 1)))
    out["eval_loss"] = (dp_comm.all_reduce(eval_sum) / _counted([(inputs, targets)])).item()
    for step in range(parity.STEPS):
        inputs, targets = parity.global_batch(step, case.batch)
        batches = split_batch(inputs, targets, topo.coord("dp"), case.dp, case.m)
        count = dp_comm.all_reduce(_counted(batches))  # the global batch's counted targets
        sent_before = ledger.bytes("send", "pp")
        # The data-parallel reduction averages over the dp replicas: scale by dp to leave Σ / count.
        stats = runner.step(batches, no_sync=engine.no_sync if engine is not None else None,
                            loss_scale=case.dp / count)
        if engine is not None:
            engine.finish_grad_sync()
        out["losses"].append((dp_comm.all_reduce(torch.tensor(stats.loss, dtype=torch.float64)) / count).item())
        if step == 0:
            out["peak_bytes"], out["peak_in_flight"] = stats.peak_activation_bytes, stats.peak_in_flight
            out["send_bytes"] = ledger.bytes("send", "pp") - sent_before
            if case.tp > 1:
                out["grads"] = gather_full(stage, tp_comm, grads=True)
            elif case.data == "zero1":
                out["grads"] = engine.full_gradients()
            else:
                out["grads"] = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
        _clip(case, stage, engine, pp_comm, tp_comm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _clip(case, stage, engine, pp_comm, tp_comm) -> None:
    """Clip with the norm over the whole model: the stages' squares summed over pp (and tp shards counted once)."""
    groups = {"pp": pp_comm} | ({"tp": tp_comm} if case.tp > 1 else {})  # stages and tp slices are disjoint
    if case.data == "zero1":  # ZeRO adds its own dp_cp group, over which its gradient shards are disjoint
        engine.clip_grad_norm(parity.GRAD_CLIP, extra_groups=groups)
    else:
        clip_grad_norm_(_pieces(stage), parity.GRAD_CLIP, groups)


def _rank_cases(cases: list[Case]) -> list[dict]:
    results = []
    for case in cases:
        dims = ParallelDims(dp=case.dp, tp=case.tp, pp=case.pp)
        results.append(_run_case(case, Topology(dims, dist.get_rank(), dist.get_world_size())))
    return results


@functools.lru_cache(maxsize=2)
def _results(world: int) -> list[list[dict]]:
    """results[case index][rank]."""
    per_rank = run_ranks(_rank_cases, world, CASES[world], timeout=300)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(CASES[world]))]


@functools.lru_cache(maxsize=4)
def _reference(layers: int, batch: int, tied: bool = False) -> dict:
    # parity.reference_run's lru_cache cannot hash a ModelConfig; its uncached body is the same harness.
    cfg = (CFG8 if layers == 8 else parity.CFG).replace(tie_embeddings=tied)
    return parity.reference_run.__wrapped__(cfg, parity.STEPS, batch)


def _cases() -> list[tuple[int, int]]:
    return [(world, i) for world in CASES for i in range(len(CASES[world]))]


@pytest.mark.parametrize("world,index", _cases(), ids=[CASES[w][i].name for w, i in _cases()])
def test_pipeline_matches_single_device(world: int, index: int) -> None:
    case = CASES[world][index]
    results = _results(world)[index]
    reference = _reference(case.layers, case.batch, case.tied)
    for result in results:  # every rank reports the global mean loss
        parity.assert_losses_match(result["losses"], reference["losses"], case.name)
        parity.assert_losses_match([result["eval_loss"]], reference["losses"][:1], case.name + " evaluate")
    # Gather the full gradient from the stages, by name; data-parallel replicas must hold identical copies.
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            if name in grads:
                assert torch.equal(grads[name], grad), f"{case.name}: replicas disagree on {name}"
            grads[name] = grad
    parity.assert_grads_match(grads, reference["grads"], case.name)


@pytest.mark.parametrize("world", sorted(CASES))
def test_bytes_sent_between_stages_match_the_schedule(world: int) -> None:
    # A rank sends one hidden state [rows, T, d] per micro-batch across each chunk boundary it owns, each way.
    for case, results in zip(CASES[world], _results(world)):
        if case.dp > 1 or case.tp > 1:
            continue
        rows = case.batch // case.m
        message = rows * parity.SEQ_LEN * parity.CFG.d_model * 4
        v_shape = case.schedule in V_SCHEDULES
        v, n = (2, 2 * case.pp) if v_shape else (case.v, case.pp * case.v)
        for r, result in enumerate(results):
            chunks = rank_chunks(r, case.pp, v, v_shape)  # a neighbour chunk on this rank is handed over locally
            boundaries = sum(c + 1 < n and c + 1 not in chunks for c in chunks)
            boundaries += sum(c > 0 and c - 1 not in chunks for c in chunks)
            assert result["send_bytes"] == case.m * boundaries * message, case.name


@pytest.mark.parametrize("world", sorted(CASES))
def test_1f1b_holds_fewer_activations_than_afab(world: int) -> None:
    # Measured with saved-tensor hooks: every micro-batch saves the same bytes on a given rank, so the peak is
    # (micro-batches in flight) x (bytes per micro-batch): m for AFAB, min(p - r, m) for 1F1B.
    runs = {(c.schedule, c.pp, c.m): res for c, res in zip(CASES[world], _results(world))
            if c.dp == c.tp == 1}
    for (schedule, p, m), results in runs.items():
        if schedule != "1f1b":
            continue
        for r in range(p):
            afab, one_f_one_b = runs[("afab", p, m)][r], results[r]
            assert afab["peak_in_flight"] == m and one_f_one_b["peak_in_flight"] == min(p - r, m)
            assert afab["peak_bytes"] * min(p - r, m) == one_f_one_b["peak_bytes"] * m
            if m > p - r:
                assert one_f_one_b["peak_bytes"] < afab["peak_bytes"]


@pytest.mark.parametrize("world", sorted(CASES))
def test_zero_bubble_schedules_hold_activations_until_w(world: int) -> None:
    # Measured with saved-tensor hooks: a micro-batch's tensors live from its F to its W. ZB-H1 holds p micro-batches
    # on every rank (1F1B: p − r), ZB-V 2p chunk passes, DualPipeV 2p + 1; per micro-batch a rank saves what it
    # saves under 1F1B.
    runs = {(c.schedule, c.pp, c.m): res for c, res in zip(CASES[world], _results(world))
            if c.dp == c.tp == 1 and not c.tied}
    checked = 0
    for (schedule, p, m), results in runs.items():
        if schedule not in ("zb1", "zbv", "dualpipev"):
            continue
        want = {"zb1": p, "zbv": 2 * p, "dualpipev": 2 * p + 1}[schedule]  # dualpipev: F before B in each pair
        assert [r["peak_in_flight"] for r in results] == [want] * p, (schedule, p, m)
        if schedule == "zb1":
            for r, (zb, fused) in enumerate(zip(results, runs[("1f1b", p, m)])):
                assert zb["peak_bytes"] * (p - r) == fused["peak_bytes"] * p, (p, m, r)
        checked += 1
    assert checked == {2: 4, 4: 3}[world]


def test_moe_balancing_losses_flow_through_every_stage() -> None:
    # Each chunk adds its own MoE layers' aux loss, scaled by 1/m, to its backward; the first chunk (2 dense layers)
    # has none, and adds nothing.
    cfg = parity.CFG.replace(moe={"n_experts": 4, "top_k": 2, "first_dense_layers": 2})
    inputs, targets = parity.global_batch(0)
    m = 2
    reference = build_model(cfg, seed=parity.SEED)
    lm_total = aux_total = 0.0
    for x, y in zip(inputs.chunk(m), targets.chunk(m)):
        loss = lm_loss(reference(x), y)
        aux = reference.aux_loss()
        ((loss + aux) / m).backward()
        lm_total, aux_total = lm_total + loss.item() / m, aux_total + aux.item() / m
    stage = partition_model(build_model(cfg, seed=parity.SEED), 0, 1, 2)
    batches = list(zip(inputs.chunk(m), targets.chunk(m)))
    count = _counted(batches)
    stats = PipelineRunner(stage, Comm(), "interleaved", m, with_aux=True).step(batches, loss_scale=1 / count)
    assert aux_total > 0
    assert stats.loss / count.item() == pytest.approx(lm_total, rel=1e-6)
    assert stats.aux_loss == pytest.approx(aux_total, rel=1e-6)
    parity.assert_grads_match({n: p.grad for n, p in stage.named_parameters()},
                              {n: p.grad for n, p in reference.named_parameters()}, "moe pp1 v2")


# ---------------------------------------------------------------------------------------------------------------
# Loss normalization by the global token count, and the model's partial forward
# ---------------------------------------------------------------------------------------------------------------


def _rank_step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """One 1F1B step on two stages, scaled by the tokens the micro-batches count: (mean loss, gradients)."""
    topo = Topology(ParallelDims(pp=2), dist.get_rank(), dist.get_world_size())
    stage = partition_model(build_model(parity.CFG, seed=parity.SEED), topo.coord("pp"), 2)
    count = _counted(batches)
    stats = PipelineRunner(stage, topo.comm("pp"), "1f1b", len(batches)).step(batches, loss_scale=1 / count)
    return {"loss": stats.loss / count.item(), "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def test_micro_batches_with_different_token_counts_give_the_global_token_mean() -> None:
    # Micro-batch 0 (rows 0-3) counts 69 targets, micro-batch 1 all 128: the mean of the two micro-batch means
    # (the old 1/m rule) weighs micro-batch 0's tokens almost twice as much as the whole-batch mean does.
    inputs, targets = parity.global_batch(0)
    targets = targets.clone()
    targets[0] = IGNORE
    targets[1, 5:] = IGNORE
    batches = list(zip(inputs.chunk(2), targets.chunk(2)))
    assert [int((y != IGNORE).sum()) for _, y in batches] == [69, 128]
    reference = build_model(parity.CFG, seed=parity.SEED)
    loss = lm_loss(reference(inputs), targets)  # the mean over every counted target of the batch
    loss.backward()
    results = run_ranks(_rank_step, 2, batches, timeout=300)
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)
    grads = {name: grad for result in results for name, grad in result["grads"].items()}
    parity.assert_grads_match(grads, {n: p.grad for n, p in reference.named_parameters()}, "pp2 ignored targets")


def test_a_forward_over_groups_of_blocks_equals_the_whole_forward() -> None:
    # What a stage runs: embedding + some blocks, other blocks on hidden states, the last blocks + head.
    cfg = CFG8.replace(moe={"n_experts": 4, "top_k": 2, "first_dense_layers": 3})
    model = build_model(cfg, seed=parity.SEED)
    tokens, _ = parity.global_batch(0)
    hidden = model(tokens, blocks=[0, 1, 2], head=False)
    assert hidden.shape == (*tokens.shape, cfg.d_model)
    assert not model.aux_loss([0, 1, 2]).requires_grad  # dense blocks: nothing to backpropagate
    hidden = model(hidden, blocks=[3, 4], embed=False, head=False)
    aux_parts = model.aux_loss([3, 4])
    logits = model(hidden, blocks=range(5, 8), embed=False)
    aux_parts = aux_parts + model.aux_loss(range(5, 8))
    whole = model(tokens)
    assert torch.equal(logits, whole)
    assert torch.allclose(aux_parts, model.aux_loss(), rtol=1e-6) and aux_parts > 0


# ---------------------------------------------------------------------------------------------------------------
# The dtype on the wire: what the sending stage sends
# ---------------------------------------------------------------------------------------------------------------


def _bf16_step(batches: list[tuple[torch.Tensor, torch.Tensor]], pp: int) -> dict:
    """One 1F1B step of a bf16 model (bf16 weights: a bf16 residual stream) on `pp` stages."""
    topo = Topology(ParallelDims(pp=pp), dist.get_rank() if pp > 1 else 0, pp)
    model = build_model(parity.CFG, seed=parity.SEED).to(torch.bfloat16)
    stage = partition_model(model, topo.coord("pp"), pp)
    runner = PipelineRunner(stage, topo.comm("pp") if pp > 1 else Comm(), "1f1b", len(batches))
    stats = runner.step(batches, loss_scale=1.0)
    return {"dtype": runner.activation_dtype, "loss": stats.loss,
            "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}


def test_a_bf16_activation_stream_travels_as_bf16() -> None:
    # fp32 receive buffers (the old default) cannot take a bf16 stage output: half the bytes, other values. The
    # two-stage step must be the one-rank step bit for bit: the receiver gets the sender's dtype and bits.
    inputs, targets = parity.global_batch(0)
    batches = list(zip(inputs.chunk(2), targets.chunk(2)))
    reference = _bf16_step(batches, 1)
    results = run_ranks(_bf16_step, 2, batches, 2, timeout=300)
    assert [r["dtype"] for r in results] == [torch.bfloat16] * 2
    assert all(r["loss"] == reference["loss"] for r in results)
    grads = {name: grad for r in results for name, grad in r["grads"].items()}
    assert grads.keys() == reference["grads"].keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, reference["grads"][name]), name


def test_a_message_of_another_dtype_than_the_receiver_expects_is_refused() -> None:
    stage = partition_model(build_model(parity.CFG, seed=parity.SEED), 0, 1)
    assert PipelineRunner(stage, Comm(), "1f1b", 2).activation_dtype == torch.float32  # fp32 weights, fp32 stream
    wire = InFlight(Comm(), torch.float32, torch.device("cpu"))
    message = Message(F, 0, 1)
    post = Post((Op(SEND, 1, message),))
    with pytest.raises(ValueError, match="is torch.bfloat16, but the receiving stage expects torch.float32"):
        wire.post(post, lambda m: torch.zeros(2, dtype=torch.bfloat16), lambda m: (2,))
