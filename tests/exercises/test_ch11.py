"""Grade chapter 11's exercises: the bookkeeping of an expert-parallel dispatch.

`pytest tests/exercises -k ch11` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The cases are the chapter's example (2 ep ranks, 4 experts, top-2, 6 tokens per rank: the notebook draws it) and
random ones; the oracles are `minidist.parallel.ep.expert` (expert_owner, arrival_order) and the properties that
define each answer. The last test runs a whole dispatch and combine on one process with your functions.
"""

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
