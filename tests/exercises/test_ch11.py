"""Grade chapter 11's exercises: the bookkeeping of an expert-parallel dispatch.

`pytest tests/exercises -k ch11` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The cases are the chapter's example (2 ep ranks, 4 experts, top-2, 6 tokens per rank: the notebook draws it) and
random ones; the oracles are `minidist.parallel.ep.expert` (expert_owner, arrival_order) and the properties that
define each answer. The last test runs a whole dispatch and combine on one process with your functions.
"""

import importlib

import pytest
import torch
from grading import load

from minidist.parallel.ep.expert import arrival_order, expert_owner

MODULE = "ch11_expert"
pytestmark = pytest.mark.usefixtures("one_thread")

# The chapter's example: each rank's 6 tokens choose 2 of 4 experts (experts 0, 1 on rank 0; 2, 3 on rank 1).
CHOICES = [torch.tensor([[0, 2], [3, 1], [2, 3], [0, 1], [2, 0], [3, 2]]),
           torch.tensor([[1, 0], [2, 3], [0, 1], [3, 0], [1, 2], [0, 3]])]
N, EP = 4, 2


def _slots(choices: torch.Tensor) -> torch.Tensor:
    """Expert id of each slot r·T + t (choice rank r, token t), as chapter 06 numbers them."""
    return choices.t().reshape(-1)


def _random_experts(seed: int, n: int, ep: int, size: int) -> torch.Tensor:
    return torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(seed))


def _send_hint(got, experts: torch.Tensor, n: int, ep: int) -> str:
    if not torch.is_tensor(got):
        return " — return a tensor"
    if got.numel() == n and n != ep:
        return " — one count per destination rank (ep of them), not per expert"
    if got.numel() == ep and torch.equal(got.long(), torch.bincount(experts % ep, minlength=ep)):
        return " — experts sit in contiguous blocks: expert e lives on rank e // (N/ep), not e % ep"
    if got.numel() < ep:
        return " — pass minlength=ep to bincount: a rank that gets nothing still has a count (0)"
    return ""


def test_ch11_send_counts_of_the_example(impl: str) -> None:
    send_counts = load(impl, MODULE, "send_counts")
    for rank, want in enumerate(([5, 7], [7, 5])):
        experts = _slots(CHOICES[rank])
        got = send_counts(experts, N, EP)
        assert torch.is_tensor(got) and got.tolist() == want, (
            f"send_counts(rank {rank}'s slots {experts.tolist()}, N=4, ep=2): got {got}, expected {want}"
            f"{_send_hint(got, experts, N, EP)}")


@pytest.mark.parametrize("n, ep", [(8, 4), (16, 8), (6, 3)])
def test_ch11_send_counts_random(impl: str, n: int, ep: int) -> None:
    send_counts = load(impl, MODULE, "send_counts")
    experts = _random_experts(n * ep, n, ep, 40)
    experts[experts // (n // ep) == ep - 1] = 0  # the last rank gets nothing: its count must still be there
    want = torch.bincount(expert_owner(experts, n, ep), minlength=ep)
    got = send_counts(experts, n, ep)
    assert torch.is_tensor(got) and got.shape == want.shape and torch.equal(got.long(), want), (
        f"send_counts(N={n}, ep={ep}): got {got}, expected {want.tolist()}{_send_hint(got, experts, n, ep)}")


def test_ch11_receive_counts(impl: str) -> None:
    receive_counts = load(impl, MODULE, "receive_counts")
    g = torch.Generator().manual_seed(1)
    cases = [(torch.tensor([[3, 2, 4, 3], [4, 3, 2, 3]]), "the chapter's matrix"),
             (torch.randint(0, 9, (4, 8), generator=g), "ep=4, N=8")]
    for matrix, label in cases:
        ep, n = matrix.shape
        for rank in range(ep):
            want = matrix[:, rank * n // ep:(rank + 1) * n // ep].sum(1)
            got = receive_counts(matrix, rank)
            sent = matrix[rank].view(ep, -1).sum(1)
            hint = " — that is what the rank sends (its row); it receives the column block of its own experts" \
                if torch.is_tensor(got) and got.shape == sent.shape and torch.equal(got.long(), sent) else ""
            assert torch.is_tensor(got) and got.shape == want.shape and torch.equal(got.long(), want), (
                f"receive_counts({label} {matrix.tolist()}, rank {rank}): got {got}, expected {want.tolist()}{hint}")


def _check_order(got, experts: torch.Tensor, n: int, ep: int, where: str) -> None:
    size = experts.numel()
    assert torch.is_tensor(got) and got.shape == (size,), f"{where}: expected an int64 tensor of shape ({size},)"
    assert torch.equal(got.sort().values, torch.arange(size)), f"{where}: not a permutation of 0..{size - 1}"
    dest = expert_owner(experts, n, ep)[got]
    assert bool((dest[1:] >= dest[:-1]).all()), (
        f"{where}: destinations in your order are {dest.tolist()}, not sorted (rank 0's slots first)")
    sorted_experts = experts[got]
    assert bool((sorted_experts[1:] >= sorted_experts[:-1]).all()), (
        f"{where}: inside one destination the slots must be grouped by expert (the receiver's counts say how many "
        f"rows of each of its experts come from you, in expert order); got experts {sorted_experts.tolist()}")
    for e in range(n):
        mine = got[experts[got] == e]
        assert bool((mine[1:] > mine[:-1]).all()), (
            f"{where}: the slots for expert {e} come as {mine.tolist()}: keep their original order — sort with "
            "stable=True")


def test_ch11_destination_order(impl: str) -> None:
    destination_order = load(impl, MODULE, "destination_order")
    experts = _slots(CHOICES[0])
    _check_order(destination_order(experts, N, EP), experts, N, EP, "destination_order(the chapter's rank 0)")
    for seed, (n, ep) in enumerate([(8, 4), (64, 8), (6, 3)]):
        experts = _random_experts(seed, n, ep, 200)  # many ties: stability is tested
        _check_order(destination_order(experts, n, ep), experts, n, ep, f"destination_order(N={n}, ep={ep})")


def test_ch11_inverse_permutation(impl: str) -> None:
    inverse_permutation = load(impl, MODULE, "inverse_permutation")
    for seed, size in enumerate((1, 7, 300)):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
        got = inverse_permutation(order)
        ok = torch.is_tensor(got) and got.shape == order.shape and torch.equal(order[got], torch.arange(size)) \
            and torch.equal(got[order], torch.arange(size))
        hint = " — order[order] applies the permutation twice; the inverse sends position order[i] back to i" \
            if torch.is_tensor(got) and got.shape == order.shape and torch.equal(got, order[order]) else ""
        assert ok, f"inverse_permutation(a permutation of {size}): x[order][inverse] must be x{hint}"


def test_ch11_local_expert_order(impl: str) -> None:
    local_expert_order = load(impl, MODULE, "local_expert_order")
    received = torch.tensor([[3, 2], [4, 3]])
    want = [0, 1, 2, 5, 6, 7, 8, 3, 4, 9, 10, 11]
    got = local_expert_order(received)
    assert torch.is_tensor(got) and got.tolist() == want, (
        f"local_expert_order({received.tolist()}) for the chapter's rank 0: got {got}, expected {want} — the "
        "arrivals are grouped by source rank, then by local expert; sort them by local expert, stably")
    g = torch.Generator().manual_seed(2)
    for ep, local in ((4, 2), (8, 1), (3, 5)):
        received = torch.randint(0, 5, (ep, local), generator=g)
        got = local_expert_order(received)
        assert torch.is_tensor(got) and torch.equal(got, arrival_order(received)), (
            f"local_expert_order(ep={ep}, {local} local experts): differs from minidist's arrival_order — stable: "
            "inside one expert, source rank 0's rows first")


def test_ch11_a_whole_dispatch_and_combine_on_one_process(impl: str) -> None:
    """Your five functions, composed as minidist composes them: every slot's row reaches the rank of its expert,
    grouped by local expert, and every output comes back to its slot."""
    fns = {name: load(impl, MODULE, name) for name in ("send_counts", "receive_counts", "destination_order",
                                                       "inverse_permutation", "local_expert_order")}
    experts = [_slots(c) for c in CHOICES]
    rows = [torch.stack([torch.full((len(e),), float(r)), torch.arange(len(e)).float(), e.float()], 1)
            for r, e in enumerate(experts)]  # each row says (source rank, slot, expert)
    orders = [fns["destination_order"](e, N, EP) for e in experts]
    matrix = torch.stack([torch.bincount(e, minlength=N) for e in experts])
    sends = [fns["send_counts"](e, N, EP).tolist() for e in experts]
    pieces = [rows[r][orders[r]].split(sends[r]) for r in range(EP)]  # the dispatch all-to-all, by hand
    outputs = []
    for rank in range(EP):
        recv = fns["receive_counts"](matrix, rank)
        arrived = torch.cat([pieces[src][rank] for src in range(EP)])
        assert [p[rank].shape[0] for p in pieces] == recv.tolist(), f"rank {rank}: receive counts != rows sent"
        received = matrix[:, 2 * rank:2 * rank + 2]
        order = fns["local_expert_order"](received)
        grouped = arrived[order]
        assert bool((grouped[1:, 2] >= grouped[:-1, 2]).all()) and set(grouped[:, 2].long().tolist()) <= \
            {2 * rank, 2 * rank + 1}, f"rank {rank}: arrivals not grouped by its own experts"
        result = grouped * torch.tensor([1.0, 1.0, 10.0])  # "the expert": scales the expert column
        outputs.append(result[fns["inverse_permutation"](order)].split(recv.tolist()))
    for src in range(EP):  # the combine all-to-all, by hand, then back to slot order
        back = torch.cat([outputs[dst][src] for dst in range(EP)])[fns["inverse_permutation"](orders[src])]
        assert torch.equal(back[:, :2], rows[src][:, :2]), f"rank {src}: outputs did not return to their slots"
        assert torch.equal(back[:, 2], 10 * rows[src][:, 2]), f"rank {src}: an output came back to another slot"


# ------------------------------------------------------------------------------------------------------------------
# On real ranks: the differentiable all-to-all, the dispatch and the combine (one launch runs every case)

EP_WORLD, DIM = 3, 4
# (name, experts N, slots on each rank, router): "random" draws experts uniformly; "no rank 2" never picks rank 2's
# experts; "collapsed" sends every slot of every rank to the last expert (that rank receives S·T·k rows: all of them).
EP_CASES = [("random router, N=6", 6, (8, 8, 8), "random"), ("uneven slots per rank (3, 5, 7)", 6, (3, 5, 7), "random"),
            ("no slot for rank 2's experts", 6, (6, 6, 6), "no rank 2"),
            ("collapsed router: every slot to expert 5", 6, (5, 4, 6), "collapsed"),
            ("one expert per rank, N=3", 3, (7, 2, 5), "random")]


def _ep_inputs(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slots x [S, DIM], their experts [S], a probe for the loss [S, DIM], and every expert's W."""
    _, n, slots, router = EP_CASES[case]
    g = torch.Generator().manual_seed(1000 * case + rank)
    s = slots[rank]
    x = torch.randn(s, DIM, generator=g, dtype=torch.float64)
    high = n if router != "no rank 2" else 2 * n // EP_WORLD
    experts = torch.randint(0, high, (s,), generator=g)
    if router == "collapsed":
        experts = torch.full((s,), n - 1)
    probe = torch.randn(s, DIM, generator=g, dtype=torch.float64)
    weights = torch.randn(n, DIM, DIM, generator=torch.Generator().manual_seed(case), dtype=torch.float64)
    return x, experts, probe, weights


def _rows_case(case: int, rank: int) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """all_to_all_rows alone: rank's rows, and the full count matrix counts[i][j] = rows rank i sends to rank j."""
    g = torch.Generator().manual_seed(77 + case)
    counts = torch.randint(0, 4, (EP_WORLD, EP_WORLD), generator=g)
    if case == 1:
        counts[:, 2] = 0  # nobody sends to rank 2: it receives an empty tensor
    x = torch.randn(int(counts[rank].sum()), DIM, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    return x, counts[rank].tolist(), counts.tolist()


def _checked_all_to_all(dist, original):
    """dist.all_to_all_single that first compares every rank's splits (all ranks alike), so that a mismatch becomes
    a ValueError on every rank instead of gloo aborting the process."""
    def call(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        world = dist.get_world_size()
        outs = list(output_split_sizes) if output_split_sizes else [output.shape[0] // world] * world
        ins = list(input_split_sizes) if input_split_sizes else [input.shape[0] // world] * world
        table: list = [None] * world
        dist.all_gather_object(table, (ins, outs, input.shape[0], output.shape[0]))
        for i, (ins_i, outs_i, rows_in, rows_out) in enumerate(table):
            if sum(ins_i) != rows_in or sum(outs_i) != rows_out:
                raise ValueError(f"rank {i}: split sizes {ins_i} -> {outs_i} for tensors of {rows_in} -> {rows_out} "
                                 "rows (split sizes do not fit)")
            for j in range(world):
                if ins_i[j] != table[j][1][i]:
                    raise ValueError(f"rank {i} sends {ins_i[j]} rows to rank {j}, which expects {table[j][1][i]} "
                                     "(receive split sizes that do not match what the senders send)")
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
    return call


def ep_worker(impl: str) -> dict:
    import torch.distributed as dist

    module = importlib.import_module(f"{impl}.{MODULE}")
    rank = dist.get_rank()
    dist.all_to_all_single = _checked_all_to_all(dist, dist.all_to_all_single)  # this rank process only
    out: dict = {"rows": [], "layer": []}
    phase = "all_to_all_rows"
    try:
        for case in range(2):
            x, send, counts = _rows_case(case, rank)
            x.requires_grad_(True)
            recv = [counts[i][rank] for i in range(EP_WORLD)]
            got = module.all_to_all_rows(x, send, recv)
            got.backward(torch.arange(got.numel(), dtype=got.dtype).view_as(got) + 100 * rank)
            out["rows"].append({"out": got.detach(), "grad": None if x.grad is None else x.grad.clone()})
        phase = "dispatch + combine"
        for case, (_, n, _, _) in enumerate(EP_CASES):
            x, experts, probe, weights = _ep_inputs(case, rank)
            per = n // EP_WORLD
            x.requires_grad_(True)
            w_local = weights[rank * per:(rank + 1) * per].clone().requires_grad_(True)
            received, local_expert, state = module.dispatch(x, experts, n)
            y = torch.einsum("rd,rde->re", received, w_local[local_expert])
            result = module.combine(y, state)
            (result * probe).sum().backward()
            out["layer"].append({"received": received.detach(), "local_expert": local_expert.clone(),
                                 "out": result.detach(), "x_grad": None if x.grad is None else x.grad.clone(),
                                 "w_grad": None if w_local.grad is None else w_local.grad.clone()})
    except NotImplementedError as missing:
        return {"missing": str(missing)}
    except Exception as error:  # noqa: BLE001  (every rank raises alike here: report the cause, not a traceback)
        return {"error": f"{phase} raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return out


@pytest.fixture(scope="module")
def ep_run(impl: str) -> list[dict]:
    from minidist.comm.launch import run_ranks
    case = (f"world {EP_WORLD}: {impl}.{MODULE}.all_to_all_rows on 2 count matrices, then dispatch + combine on "
            f"{len(EP_CASES)} routers")
    return run_ranks(ep_worker, EP_WORLD, impl, timeout=90, threads_per_rank=1, case=case)


def phase_of(message: str) -> str:
    return message.split(" raised ")[0]


def _ep_missing(per_rank: list[dict], impl: str) -> None:
    for rank, result in enumerate(per_rank):
        if "missing" in result:
            pytest.fail(f"{impl}.{MODULE}: not implemented yet ({result['missing']})", pytrace=False)
        if "error" in result:
            message = result["error"]
            hint = ""
            if "expects" in message and phase_of(message) == "dispatch + combine":
                hint = (" — a rank cannot know what it receives from its own router: exchange the per-expert counts "
                        "first (a small all-to-all), and take the receive splits from that")
            elif "split" in message.lower():
                hint = (" — split sizes that do not fit the tensor: in the backward the gradient has sum(recv) rows "
                        "and goes back where it came from, so its input splits are recv and its output splits send")
            elif "invalid gradient" in message:
                hint = " — backward returns one gradient row per row of x (sum(send) rows), and None for the counts"
            pytest.fail(f"world {EP_WORLD}, rank {rank}: {message}{hint}", pytrace=False)


def test_ch11_all_to_all_rows_forward_and_gradient(ep_run: list[dict], impl: str) -> None:
    _ep_missing(ep_run, impl)
    for case in range(2):
        xs = [_rows_case(case, r)[0] for r in range(EP_WORLD)]
        counts = _rows_case(case, 0)[2]
        pieces = [list(torch.split(xs[i], counts[i])) for i in range(EP_WORLD)]  # pieces[i][j]: rank i → rank j
        for rank in range(EP_WORLD):
            where = f"all_to_all_rows, world {EP_WORLD}, count matrix {counts}, rank {rank}"
            got = ep_run[rank]["rows"][case]
            want = torch.cat([pieces[i][rank] for i in range(EP_WORLD)])
            assert got["out"].shape == want.shape and torch.equal(got["out"], want), (
                f"{where}: received {tuple(got['out'].shape)} rows that are not rank 0's rows for it, then rank 1's, "
                f"... ({tuple(want.shape)} expected) — output splits are what each rank sends *here*")
            # The gradient each received row gets is arange + 100·receiver: the sender must get it back per row.
            grads = []
            for j in range(EP_WORLD):
                start = sum(counts[i][j] for i in range(rank))
                size = counts[rank][j]
                flat = torch.arange(sum(counts[i][j] for i in range(EP_WORLD)) * DIM, dtype=torch.float64)
                grads.append((flat.view(-1, DIM) + 100 * j)[start:start + size])
            want_grad = torch.cat(grads)
            assert got["grad"] is not None, (
                f"{where}: x.grad is None — the all-to-all is invisible to autograd: wrap it in a "
                "torch.autograd.Function whose backward sends the gradient back")
            assert torch.equal(got["grad"], want_grad), (
                f"{where}: x.grad is not the gradient of the rows this rank sent — the adjoint of the all-to-all is "
                "the reverse all-to-all: what you received you send back, so input and output splits swap")


def _one_device(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, experts, probe, weights = _ep_inputs(case, rank)
    return torch.einsum("sd,sde->se", x, weights[experts]), torch.einsum("se,sde->sd", probe, weights[experts])


def test_ch11_dispatch_delivers_each_row_to_its_expert(ep_run: list[dict], impl: str) -> None:
    _ep_missing(ep_run, impl)
    for case, (name, n, _, _) in enumerate(EP_CASES):
        per = n // EP_WORLD
        for rank in range(EP_WORLD):
            got = ep_run[rank]["layer"][case]
            want_rows, want_experts = [], []
            for source in range(EP_WORLD):
                x, experts, _, _ = _ep_inputs(case, source)
                for e in range(rank * per, (rank + 1) * per):
                    want_rows.append(x[experts == e])
                    want_experts += [e - rank * per] * int((experts == e).sum())
            want = torch.cat(want_rows)
            where = f"dispatch, world {EP_WORLD}, case {name!r}, rank {rank}"
            assert got["received"].shape == want.shape, (
                f"{where}: received {got['received'].shape[0]} rows, expected {want.shape[0]} — the receive counts "
                "come from the counts exchange (what every other rank routes here), not from this rank's send counts")
            assert torch.equal(got["received"], want), (
                f"{where}: the right number of rows, in the wrong order or the wrong rows — rows leave sorted by "
                "destination then expert, stably (source rank 0's first on arrival)")
            assert got["local_expert"].tolist() == want_experts, (
                f"{where}: local_expert {got['local_expert'].tolist()}, expected {want_experts} — local indices "
                f"are 0..{per - 1} (global id − rank·N/ep), one run per (source, expert) with the exchanged counts")


def test_ch11_combine_forward_and_gradients_equal_the_one_device_layer(ep_run: list[dict], impl: str) -> None:
    _ep_missing(ep_run, impl)
    for case, (name, n, _, _) in enumerate(EP_CASES):
        per = n // EP_WORLD
        weights = _ep_inputs(case, 0)[3]
        w_grad = torch.zeros_like(weights)
        for source in range(EP_WORLD):
            x, experts, probe, _ = _ep_inputs(case, source)
            w_grad.index_add_(0, experts, torch.einsum("sd,se->sde", x, probe))
        for rank in range(EP_WORLD):
            got = ep_run[rank]["layer"][case]
            want_out, want_x_grad = _one_device(case, rank)
            where = f"combine, world {EP_WORLD}, case {name!r}, rank {rank}"
            x, experts, _, _ = _ep_inputs(case, rank)
            order = torch.argsort(experts, stable=True)
            assert got["out"].shape == want_out.shape, \
                f"{where}: output {tuple(got['out'].shape)}, expected {tuple(want_out.shape)} (one row per slot)"
            if not torch.allclose(got["out"], want_out, rtol=1e-10, atol=1e-10):
                hint = (" — these are the outputs in destination order: undo the sort with the inverse permutation"
                        if torch.allclose(got["out"], want_out[order]) else
                        " — the outputs go back with the reverse all-to-all (the dispatch's splits swapped)")
                pytest.fail(f"{where}: differs from the one-device layer x @ W[expert] by up to "
                            f"{(got['out'] - want_out).abs().max().item():.2e}{hint}", pytrace=False)
            assert got["x_grad"] is not None and torch.allclose(got["x_grad"], want_x_grad, rtol=1e-10, atol=1e-10), (
                f"{where}: x.grad differs from the one-device layer's — both all-to-alls must be the differentiable "
                "all_to_all_rows, and the destination sort an indexing autograd can follow")
            want_w = w_grad[rank * per:(rank + 1) * per]
            assert got["w_grad"] is not None and torch.allclose(got["w_grad"], want_w, rtol=1e-10, atol=1e-10), (
                f"{where}: the local experts' weight gradient differs from the sum over every rank's slots routed "
                "to them — a row reached the wrong local expert (check local_expert)")
