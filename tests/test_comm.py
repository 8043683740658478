"""minidist.comm.communicator, p2p_collectives and cost_model: ring collectives agree with torch's, the ledger's bytes
equal the formulas exactly, the cost model.

One launch per world size (2, 3, 4) runs every multi-rank case and returns (category, label, got, expected) rows;
the tests below check one category each. Inputs are integer-valued, so every sum is exact and comparisons are
equalities. The oracle is torch.distributed (for the ring functions) or a sum computed locally from every rank's
input (each rank can regenerate any rank's input from its seed).
"""

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Ledger, chunk_sizes, ring_bytes_sent
from minidist.comm.cost_model import alpha_beta_time, cost_terms, fit_alpha_beta
from minidist.comm.launch import run_ranks
from minidist.comm.p2p_collectives import (
    naive_all_reduce,
    pairwise_all_to_all,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

SIZES = [1, 7, 13, 1001]  # none divisible by 2, 3 and 4 at once; 1 is smaller than every group


def _x(rank: int, shape, salt: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * salt + rank)
    return torch.randint(-99, 100, tuple(shape), generator=g).to(dtype)


def _sum_over(members, shape, salt=0, dtype=torch.float32) -> torch.Tensor:
    return sum(_x(r, shape, salt, dtype) for r in members)


def _exact(m: Fraction) -> int:
    assert m.denominator == 1, f"{m} bytes is not a whole number"
    return int(m)


def comm_cases() -> list[tuple]:
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    half_groups = [dist.new_group(h) for h in halves]  # collective: every rank creates both
    mine = rank % 2
    rows = []

    def check(category, label, got, expected):
        rows.append((category, f"rank {rank}: {label}", got, expected))

    # --- hand-built ring collectives vs torch, on the world and on a sub-group of non-adjacent ranks -----------
    for layout, group, members in [("world", None, list(range(world))), ("half", half_groups[mine], halves[mine])]:
        ledger = Ledger()
        comm = Comm(group, ledger, name=layout)
        p, me = comm.size, comm.rank
        assert comm.ranks == members
        for n in SIZES:
            for shape, dtype in [((n,), torch.float32), ((n, 3), torch.float64)]:
                tag = f"{layout} p={p} shape={shape}"
                x = _x(rank, shape, n, dtype)
                reference = x.clone()
                dist.all_reduce(reference, group=group)
                m = x.numel() * x.element_size()

                ledger.reset()
                y = x.clone()
                out = ring_all_reduce(y, comm)
                check("ring", f"all_reduce {tag}", y, reference)
                check("ring", f"all_reduce returns its input {tag}", out.data_ptr(), y.data_ptr())
                check("ring", f"all_reduce given a bare group {tag}", ring_all_reduce(x.clone(), group), reference)
                check("ring_bytes", f"all_reduce {tag}", ledger.bytes("ring_all_reduce"),
                      ring_bytes_sent("all_reduce", shape, x.element_size(), p, me))
                rows.append(("ring_total", (layout, "all_reduce", shape), tuple(members), ledger.bytes(), 2 * m))

                ledger.reset()
                shard = ring_reduce_scatter(x, comm)
                check("ring", f"reduce_scatter {tag}", shard, torch.tensor_split(reference, p)[me])
                check("ring", f"reduce_scatter leaves its input {tag}", x, _x(rank, shape, n, dtype))
                check("ring_bytes", f"reduce_scatter {tag}", ledger.bytes("ring_reduce_scatter"),
                      ring_bytes_sent("reduce_scatter", shape, x.element_size(), p, me))
                rows.append(("ring_total", (layout, "reduce_scatter", shape), tuple(members), ledger.bytes(), m))

                # All-gather of the uneven shards undoes the reduce-scatter.
                ledger.reset()
                sizes = [len(c) for c in torch.tensor_split(reference, p)]
                check("ring", f"all_gather of uneven shards {tag}", ring_all_gather(shard, comm, sizes), reference)
                check("ring_bytes", f"all_gather uneven {tag}", ledger.bytes("ring_all_gather"),
                      ring_bytes_sent("all_gather", shape, x.element_size(), p, me))
                rows.append(("ring_total", (layout, "all_gather", shape), tuple(members), ledger.bytes(), m))

                # Even all-gather against torch's.
                gathered = x.new_empty((p * shape[0], *shape[1:]))
                dist.all_gather_into_tensor(gathered, x, group=group)
                check("ring", f"all_gather {tag}", ring_all_gather(x, comm), gathered)

                y = x.clone()
                naive_all_reduce(y, comm)
                check("naive", f"naive_all_reduce {tag}", y, reference)

        # Naive bytes: the root sends the sum to each of the others, the others send their tensor once.
        ledger.reset()
        x = _x(rank, (13,), 1)
        naive_all_reduce(x, comm)
        m = x.numel() * x.element_size()
        check("naive_bytes", f"naive_all_reduce {layout} p={p}", ledger.bytes("naive_all_reduce"),
              (p - 1) * m if me == 0 else (m if p > 1 else 0))

        # Uneven all-to-all from point-to-point messages vs torch's: member me sends (me + j) % 3 rows to member j.
        send_rows = [(me + j) % 3 for j in range(p)]
        recv_rows = [(j + me) % 3 for j in range(p)]
        x = _x(rank, (sum(send_rows), 2), 5)
        expected = x.new_empty((sum(recv_rows), 2))
        dist.all_to_all_single(expected, x, recv_rows, send_rows, group=group)
        check("ring", f"pairwise_all_to_all {layout}", pairwise_all_to_all(x, comm, send_rows, recv_rows), expected)

    # --- Comm's torch collectives: values against local sums, ledger against the textbook formulas -------------
    ledger = Ledger()
    comm = Comm(None, ledger)
    p = world
    everyone = range(world)

    def bytes_of(op):
        value = ledger.bytes(op)
        ledger.reset()
        return value

    x = _x(rank, (12,), 1)  # 12 divides by 2, 3 and 4: the formulas are whole numbers
    m = x.numel() * 4
    check("values", "all_reduce", comm.all_reduce(x.clone()), _sum_over(everyone, (12,), 1))
    check("bytes", "all_reduce = 2(p-1)/p M", bytes_of("all_reduce"), _exact(Fraction(2 * (p - 1), p) * m))
    check("values", "all_reduce avg", comm.all_reduce(x.clone(), op="avg"), _sum_over(everyone, (12,), 1) / p)
    check("values", "all_reduce max", comm.all_reduce(x.clone(), op="max"),
          torch.stack([_x(r, (12,), 1) for r in everyone]).amax(0))
    handle = comm.all_reduce(x.clone(), async_op=True)
    check("values", "async all_reduce", handle.wait(), _sum_over(everyone, (12,), 1))
    handle = comm.all_reduce(x.clone(), op="avg", async_op=True)
    check("values", "async all_reduce avg", handle.wait(), _sum_over(everyone, (12,), 1) / p)
    ledger.reset()

    # Uneven size: the ledger counts what the ring sends, the same as the hand-built ring's measured bytes.
    x13 = _x(rank, (13,), 2)
    comm.all_reduce(x13.clone())
    ring_all_reduce(x13.clone(), comm)
    check("bytes", "torch all_reduce on 13 elements = ring's measured bytes", ledger.bytes("all_reduce"),
          ledger.bytes("ring_all_reduce"))
    ledger.reset()

    shard = _x(rank, (5, 2), 3)
    m = 5 * 2 * 4 * p  # the gathered output
    check("values", "all_gather", comm.all_gather(shard), torch.cat([_x(r, (5, 2), 3) for r in everyone]))
    check("bytes", "all_gather = (p-1)/p M", bytes_of("all_gather"), _exact(Fraction(p - 1, p) * m))
    handle = comm.all_gather(shard, async_op=True)
    check("values", "async all_gather", handle.wait(), torch.cat([_x(r, (5, 2), 3) for r in everyone]))
    ledger.reset()

    full = _x(rank, (4 * p, 3), 4)
    m = full.numel() * 4
    check("values", "reduce_scatter", comm.reduce_scatter(full),
          _sum_over(everyone, (4 * p, 3), 4)[4 * rank: 4 * rank + 4])
    check("bytes", "reduce_scatter = (p-1)/p M", bytes_of("reduce_scatter"), _exact(Fraction(p - 1, p) * m))
    check("values", "reduce_scatter avg", comm.reduce_scatter(full, op="avg"),
          _sum_over(everyone, (4 * p, 3), 4)[4 * rank: 4 * rank + 4] / p)
    ledger.reset()

    src = p - 1
    b = _x(rank, (12,), 6)
    check("values", "broadcast", comm.broadcast(b, src=src), _x(src, (12,), 6))
    m = 12 * 4
    check("bytes", "broadcast = 2(p-1)/p M on the source, (p-1)/p M elsewhere", bytes_of("broadcast"),
          _exact(Fraction(2 * (p - 1) if rank == src else p - 1, p) * m))

    # All-to-all, even then uneven: rank r sends (r + j) % 3 rows, filled with 100 r + j, to rank j.
    even = torch.cat([torch.full((2, 3), 100.0 * rank + j) for j in everyone])
    check("values", "all_to_all even", comm.all_to_all(even),
          torch.cat([torch.full((2, 3), 100.0 * j + rank) for j in everyone]))
    check("bytes", "all_to_all even = (p-1)/p M", bytes_of("all_to_all"), _exact(Fraction(p - 1, p) * even.numel() * 4))
    send_rows = [(rank + j) % 3 for j in everyone]
    recv_rows = [(j + rank) % 3 for j in everyone]
    uneven = torch.cat([torch.full(((rank + j) % 3, 3), 100.0 * rank + j) for j in everyone])
    check("values", "all_to_all uneven", comm.all_to_all(uneven, in_splits=send_rows, out_splits=recv_rows),
          torch.cat([torch.full(((j + rank) % 3, 3), 100.0 * j + rank) for j in everyone]))
    check("bytes", "all_to_all uneven = bytes leaving this rank", bytes_of("all_to_all"),
          (sum(send_rows) - send_rows[rank]) * 3 * 4)
    try:
        comm.all_to_all(uneven, in_splits=send_rows)  # a rank cannot guess what it will receive
        refused = False
    except ValueError as error:
        refused = "need out_splits" in str(error)
    check("values", "uneven all_to_all without out_splits is refused", refused, True)

    # Point to point around the ring, and exchange().
    msg = torch.full((7,), float(rank))
    got = torch.empty(7)
    handles = comm.exchange([(msg, (rank + 1) % p)], [(got, (rank - 1) % p)])
    for h in handles:
        h.wait()
    check("values", "exchange", got, torch.full((7,), float((rank - 1) % p)))
    check("bytes", "exchange sends = tensor bytes", bytes_of("send"), 7 * 4)
    if rank == 0:
        comm.send(msg, 1)
        check("bytes", "send = tensor bytes", ledger.bytes("send"), 7 * 4)
    elif rank == 1:
        check("values", "recv", comm.recv(torch.empty(7), 0), torch.zeros(7))
        check("bytes", "recv sends nothing", (ledger.calls("recv"), ledger.bytes("recv")), (1, 0))
    return rows


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"world{p}")
def rows(request) -> list[tuple]:
    per_rank = run_ranks(comm_cases, request.param, timeout=120)
    return [row for rank_rows in per_rank for row in rank_rows]


def _check(rows: list[tuple], category: str) -> None:
    selected = [r for r in rows if r[0] == category]
    assert selected, f"no {category} cases ran"
    for _, label, got, expected in selected:
        if isinstance(got, torch.Tensor):
            assert got.dtype == expected.dtype and torch.equal(got, expected), label
        else:
            assert got == expected, f"{label}: {got} != {expected}"


def test_ring_collectives_equal_torch(rows) -> None:
    _check(rows, "ring")


def test_ring_ledger_counts_the_bytes_of_the_formula(rows) -> None:
    _check(rows, "ring_bytes")


def test_ring_bytes_summed_over_a_group_are_p_minus_1_times_m_per_phase(rows) -> None:
    totals: dict = {}
    for _, key, members, sent, per_phase in (r for r in rows if r[0] == "ring_total"):
        entry = totals.setdefault((key, members), [0, per_phase])
        entry[0] += sent
    assert totals
    for ((layout, op, shape), members), (sent, per_phase_m) in totals.items():
        assert sent == (len(members) - 1) * per_phase_m, (layout, op, shape, members)


def test_naive_all_reduce(rows) -> None:
    _check(rows, "naive")
    _check(rows, "naive_bytes")


def test_comm_collectives_values(rows) -> None:
    _check(rows, "values")


def test_comm_ledger_equals_the_textbook_formulas(rows) -> None:
    _check(rows, "bytes")


# --- no processes needed -----------------------------------------------------------------------------------------


def test_chunk_sizes_match_tensor_split() -> None:
    for n in range(0, 30):
        for p in range(1, 9):
            assert chunk_sizes(n, p) == [len(c) for c in torch.tensor_split(torch.arange(n), p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_bytes_formulas(p: int) -> None:
    for n in [p * 6, 1, 7, 13, 1001]:
        m = n * 4
        ar = [ring_bytes_sent("all_reduce", (n,), 4, p, r) for r in range(p)]
        rs = [ring_bytes_sent("reduce_scatter", (n,), 4, p, r) for r in range(p)]
        ag = [ring_bytes_sent("all_gather", (n,), 4, p, r) for r in range(p)]
        bc = [ring_bytes_sent("broadcast", (n,), 4, p, r, src=1) for r in range(p)]
        assert sum(ar) == 2 * (p - 1) * m and sum(rs) == (p - 1) * m and sum(ag) == (p - 1) * m
        assert sum(bc) == (p - 1) * m + m - chunk_sizes(n, p)[1] * 4  # scatter (all but the source's chunk) + ring
        if n % p == 0:
            assert set(ar) == {2 * (p - 1) * m // p} and set(rs) == set(ag) == {(p - 1) * m // p}
    assert ring_bytes_sent("all_reduce", (10,), 4, 1, 0) == 0


def test_cost_model_terms() -> None:
    m, a, b = 1e6, 1e-5, 1e-9
    for p in [2, 4, 8]:
        assert alpha_beta_time("all_reduce", m, p, a, b) == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * m * b)
        assert alpha_beta_time("ring_reduce_scatter", m, p, a, b) == pytest.approx((p - 1) * (a + m / p * b))
        assert alpha_beta_time("all_gather", m, p, a, b) == pytest.approx((p - 1) * (a + m / p * b))
        assert alpha_beta_time("naive_all_reduce", m, p, a, b) == pytest.approx(2 * (p - 1) * (a + m * b))
    assert cost_terms("send", m, 2) == (1.0, m) and cost_terms("all_reduce", m, 1) == (0.0, 0.0)
    with pytest.raises(ValueError, match="no cost model"):
        cost_terms("gossip", m, 2)


def test_fit_recovers_alpha_and_beta() -> None:
    alpha, beta = 3e-5, 2e-9
    samples = [(op, m, p, alpha_beta_time(op, m, p, alpha, beta))
               for op in ("all_reduce", "naive_all_reduce") for m in (1e2, 1e4, 1e6) for p in (2, 4)]
    fit_a, fit_b = fit_alpha_beta(samples)
    assert math.isclose(fit_a, alpha, rel_tol=1e-9) and math.isclose(fit_b, beta, rel_tol=1e-9)
    # Noise-free latency-only data: beta is clipped to zero rather than going negative.
    latency_only = [("all_reduce", m, 2, 1e-4) for m in (1e2, 1e3)]
    assert fit_alpha_beta(latency_only)[1] >= 0


def test_ledger() -> None:
    ledger = Ledger()
    ledger.record("all_reduce", "dp", 100)
    ledger.record("all_reduce", "dp", 50)
    ledger.record("all_reduce", "tp", 7)
    ledger.record("send", "pp", 3, calls=2)
    assert ledger.bytes() == 160 and ledger.bytes(op="all_reduce") == 157 and ledger.bytes(group="dp") == 150
    assert ledger.calls(op="all_reduce", group="dp") == 2 and ledger.calls() == 5
    assert ledger.totals()[("send", "pp")] == {"calls": 2, "bytes": 3}
    assert "all_reduce" in ledger.table()
    ledger.reset()
    assert ledger.bytes() == 0 and ledger.totals() == {}


def test_single_rank_comm_is_the_identity() -> None:
    comm = Comm()
    x = torch.arange(6.0).reshape(3, 2)
    assert comm.size == 1 and comm.rank == 0
    assert comm.all_reduce(x.clone(), op="avg").equal(x)
    assert comm.all_gather(x).equal(x) and comm.reduce_scatter(x).equal(x) and comm.all_to_all(x).equal(x)
    assert comm.broadcast(x.clone()).equal(x) and comm.all_reduce(x.clone(), async_op=True).wait().equal(x)
    assert ring_all_reduce(x.clone(), comm).equal(x) and ring_reduce_scatter(x, comm).equal(x)
    assert naive_all_reduce(x.clone(), comm).equal(x) and ring_all_reduce(x.clone()).equal(x)  # no group: one rank
    assert comm.ledger.bytes() == 0 and comm.ledger.calls() == 9
