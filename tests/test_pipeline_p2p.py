"""The pipeline's point-to-point order under NCCL's rules, and Comm's device/dtype test mode (chapter 09).

No GPU here, so NCCL's matching (no tags, FIFO per ordered pair, each stream in order, blocking waits) is modelled
by `minidist.parallel.pp.nccl_model.replay`. The tests check the model itself on tiny programs, replay the executor's
real posting order for every schedule, and show that the same model rejects the executor's order before it posted in
steps (commit 91646a4: tagged single isend/irecv, receives posted one RECV action ahead).
"""

from __future__ import annotations

import parity
import pytest
import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model
from minidist.parallel.pp.nccl_model import RECV, SEND, Op, Post, Wait, replay
from minidist.parallel.pp.p2p import Message, message_of, p2p_program, peer_of, posting_order
from minidist.parallel.pp.pipeline import PipelineRunner, partition_model
from minidist.parallel.pp.schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    build_schedule,
    forward_only,
)

SHAPE = (4, 32, 64)  # every message of a step has one shape, so only the order can tell messages apart

# ---------------------------------------------------------------------------------------------------------------
# The model of NCCL's rules, on programs small enough to check by hand
# ---------------------------------------------------------------------------------------------------------------


def _single(kind: str, peer: int, message: str, shape: tuple[int, ...] | None = None) -> Post:
    return Post((Op(kind, peer, message, shape),), batched=False)


def test_two_blocking_sends_deadlock_and_the_same_pair_batched_does_not() -> None:
    # Each rank sends first: a send at the head of the pair's stream waits for a receive queued behind the other's.
    unbatched = [[_single(SEND, 1, "a"), _single(RECV, 1, "b"), Wait("b")],
                 [_single(SEND, 0, "b"), _single(RECV, 0, "a"), Wait("a")]]
    outcome = replay(unbatched)
    assert outcome.deadlock and set(outcome.blocked) == {0, 1} and outcome.pairs == 0
    batched = [[Post((Op(SEND, 1, "a"), Op(RECV, 1, "b"))), Wait("b")],
               [Post((Op(SEND, 0, "b"), Op(RECV, 0, "a"))), Wait("a")]]
    outcome = replay(batched)
    assert outcome.ok and outcome.pairs == 2


def test_a_swapped_order_is_reported_even_when_it_runs() -> None:
    # Same shapes, no tags: the first send meets the first receive, so "x" lands where "y" was expected.
    swapped = [[Post((Op(SEND, 1, "x", (2,)), Op(SEND, 1, "y", (2,))))],
               [Post((Op(RECV, 0, "y", (2,)), Op(RECV, 0, "x", (2,)))), Wait("x")]]
    outcome = replay(swapped)
    assert not outcome.deadlock and outcome.pairs == 2
    assert len(outcome.mismatches) == 2 and "sent x" in outcome.mismatches[0]
    resized = [[Post((Op(SEND, 1, "x", (2,)),))], [Post((Op(RECV, 0, "x", (3,)),)), Wait("x")]]
    assert replay(resized).mismatches == ["rank 0 -> rank 1, pair 0: sent x (2,), the receive expected x (3,)"]


def test_an_unmatched_receive_hangs_and_waiting_on_nothing_is_an_error() -> None:
    orphan = [[Post((Op(RECV, 1, "z"),)), Wait("z")], []]
    outcome = replay(orphan)
    assert outcome.deadlock and list(outcome.blocked) == [0]
    with pytest.raises(ValueError, match="never posted"):
        replay([[Wait("z")], []])


# ---------------------------------------------------------------------------------------------------------------
# The executor's order: every schedule, every m, as PipelineRunner posts it
# ---------------------------------------------------------------------------------------------------------------

GRID = [(s, p, m, v) for p in (2, 4, 8) for s in SCHEDULES for v in ((1, 2) if s == "interleaved" else (1,))
        for m in range(p if s == "interleaved" else 1, 3 * p + 1)]  # interleaved needs m >= pp


def _messages_between_ranks(schedule: list[list[Action]]) -> int:
    pp = len(schedule)
    return sum(a.kind in (SEND_F, SEND_B) and peer_of(a, pp) != r for r, order in enumerate(schedule) for a in order)


def test_every_schedule_posts_in_an_order_nccl_runs_without_deadlock_or_mixup() -> None:
    checked = 0
    for schedule, p, m, v in GRID:
        for actions in (build_schedule(schedule, p, m, v), forward_only(p, m, v)):  # step and evaluate
            outcome = replay(posting_order(actions, lambda message: SHAPE))
            assert outcome.ok, (schedule, p, m, v, outcome)
            assert outcome.pairs == _messages_between_ranks(actions), (schedule, p, m, v)
            checked += 1
    assert checked == 2 * len(GRID) == 2 * 146


def test_each_send_is_posted_after_its_compute_and_each_receive_before_its_use() -> None:
    # What lets the executor run the program: a send's tensor exists when its batch is posted, and a receive's
    # batch is posted (and waited for) no later than the RECV action that hands it to a compute.
    for schedule, p, m, v in GRID:
        actions = build_schedule(schedule, p, m, v)
        for r, program in enumerate(p2p_program(actions)):
            order = actions[r]
            posted_at = {op.message: planned.at for planned in program if isinstance(planned.item, Post)
                         for op in planned.item.ops}
            waited_at = {planned.item.message: planned.at for planned in program if isinstance(planned.item, Wait)}
            for i, a in enumerate(order):
                if a.kind in COMPUTE or peer_of(a, p) == r:
                    continue
                message = message_of(a)
                if a.kind in (SEND_F, SEND_B):
                    produced = max(j for j in range(i) if order[j].kind in COMPUTE)
                    assert produced < posted_at[message] <= i, (schedule, p, m, v, r, a)
                else:
                    assert posted_at[message] <= i and waited_at[message] == i, (schedule, p, m, v, r, a)


# ---------------------------------------------------------------------------------------------------------------
# The order before the steps (git show 91646a4:minidist/parallel/pp/pipeline.py), rebuilt faithfully
# ---------------------------------------------------------------------------------------------------------------


def old_posting_order(schedule: list[list[Action]], recv_ahead: int = 1) -> list[list[Post | Wait]]:
    """What PipelineRunner._run posted at 91646a4, NCCL being blind to its tags.

    A SEND action posted one tagged `dist.isend` at once. A RECV action posted the `dist.irecv`s of itself and the
    next `recv_ahead` RECV actions not yet posted, then waited on its own. The sends were waited for at the end.
    Hand-overs between chunks of one rank posted nothing.
    """
    pp = len(schedule)
    programs = []
    for r, actions in enumerate(schedule):
        program: list[Post | Wait] = []
        recv_at = [i for i, a in enumerate(actions) if a.kind in (RECV_F, RECV_B)]
        posted: set[int] = set()
        pending: list[Message] = []
        for i, a in enumerate(actions):
            if a.kind in (SEND_F, SEND_B) and peer_of(a, pp) != r:
                program.append(Post((Op(SEND, peer_of(a, pp), message_of(a), SHAPE),), batched=False))
                pending.append(message_of(a))
            elif a.kind in (RECV_F, RECV_B):
                k = recv_at.index(i)
                for j in recv_at[k:k + 1 + recv_ahead]:
                    if j not in posted and peer_of(actions[j], pp) != r:
                        program.append(Post((Op(RECV, peer_of(actions[j], pp), message_of(actions[j]), SHAPE),),
                                            batched=False))
                    posted.add(j)
                if peer_of(a, pp) != r:
                    program.append(Wait(message_of(a)))
        programs.append(program + [Wait(message) for message in pending])
    return programs


def test_the_old_order_deadlocks_1f1b_on_two_ranks_with_four_micro_batches() -> None:
    actions = build_schedule("1f1b", 2, 4)
    outcome = replay(old_posting_order(actions))
    # Rank 0 queued the send of micro-batch 2's activation behind its early receive of gradient 1; rank 1 queued
    # the send of gradient 1 behind its early receive of activation 2. Each stream waits on the other's.
    assert outcome.deadlock, outcome
    assert outcome.blocked == {0: f"waits on {Message(B, 1, 0)!r}", 1: f"waits on {Message(F, 2, 1)!r}"}
    assert replay(posting_order(actions, lambda message: SHAPE)).ok  # the same schedule, posted in steps


@pytest.mark.parametrize("schedule,pp,m,v", [("afab", 4, 4, 1), ("1f1b", 8, 8, 1), ("interleaved", 2, 4, 2)])
def test_the_old_order_deadlocks_other_schedules_too(schedule: str, pp: int, m: int, v: int) -> None:
    actions = build_schedule(schedule, pp, m, v)
    assert replay(old_posting_order(actions)).deadlock
    assert replay(posting_order(actions, lambda message: SHAPE)).ok


# ---------------------------------------------------------------------------------------------------------------
# Device discipline: Comm's test mode
# ---------------------------------------------------------------------------------------------------------------


def test_comm_test_mode_refuses_a_tensor_on_the_wrong_device_or_dtype() -> None:
    comm = Comm()  # one rank: every call would be the identity, so nothing is communicated
    wrong = torch.empty(3, device="meta")
    assert comm.all_reduce(wrong) is wrong  # without the test mode, anything goes
    with comm.expecting("cpu", {torch.float32}):
        assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))
        for call in (lambda: comm.all_reduce(wrong), lambda: comm.exchange([(wrong, 0)]),
                     lambda: comm.all_gather(torch.ones(2), out=torch.empty(2, device="meta"))):
            with pytest.raises(ValueError, match="on meta, but this Comm expects cpu"):
                call()
        with pytest.raises(ValueError, match="torch.float64"):
            comm.broadcast(torch.ones(3, dtype=torch.float64))
    assert comm.expect_device is None and comm.all_reduce(wrong) is wrong  # the block's end restores it
    strict = Comm(expect_device="meta")
    with pytest.raises(ValueError, match="on cpu, but this Comm expects meta"):
        strict.reduce_scatter(torch.ones(2))


RUNS = [("1f1b", 4, 1), ("afab", 2, 1), ("interleaved", 2, 2)]


def _strict_pipeline(runs: list[tuple[str, int, int]]) -> list[dict]:
    """Rank function: one step and one evaluation per run on two stages, every pp tensor checked (cpu, fp32)."""
    topo = Topology(ParallelDims(pp=2), dist.get_rank(), dist.get_world_size())
    inputs, targets = parity.global_batch(0)
    results = []
    for schedule, m, v in runs:
        ledger = Ledger()
        comm = topo.comm("pp", ledger)
        stage = partition_model(build_model(parity.CFG, seed=parity.SEED), topo.coord("pp"), 2, v)
        batches = list(zip(inputs.chunk(m), targets.chunk(m)))
        with comm.expecting("cpu", {torch.float32}):
            runner = PipelineRunner(stage, comm, schedule, m, v)
            loss = runner.step(batches, loss_scale=1 / targets.numel()).loss / targets.numel()
            eval_loss = runner.evaluate(batches) / targets.numel()
        results.append({"loss": loss, "eval_loss": eval_loss, "sends": ledger.calls("send", "pp"),
                        "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
                        "program": runner.program == p2p_program(build_schedule(schedule, 2, m, v))[topo.coord("pp")]})
    return results


def test_the_pipeline_hands_comm_only_cpu_fp32_tensors_and_matches_one_device() -> None:
    per_rank = run_ranks(_strict_pipeline, 2, RUNS, timeout=120)
    reference = parity.reference_run()
    for i, (schedule, m, v) in enumerate(RUNS):
        results = [per_rank[r][i] for r in range(2)]
        name = f"pp2 {schedule} m={m} v={v} under Comm.expecting(cpu, fp32)"
        for result in results:
            assert result["program"], name  # the runner posts the program the NCCL replay checked
            parity.assert_losses_match([result["loss"], result["eval_loss"]], reference["losses"][:1] * 2, name)
        for r, result in enumerate(results):  # every message went through Comm, into its ledger
            sends = [a for actions in (build_schedule(schedule, 2, m, v), forward_only(2, m, v))
                     for a in actions[r] if a.kind in (SEND_F, SEND_B)]
            assert result["sends"] == len(sends) > 0, name
        grads = {n: g for result in results for n, g in result["grads"].items()}
        parity.assert_grads_match(grads, reference["grads"], name)
