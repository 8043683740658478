"""Grade chapter 06's exercises: the sequence-wise balance loss, dropping by score, and group-limited routing.

`pytest tests/exercises -k ch06` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles are `minidist.model.moe` (the batch-wise loss per sequence, GShard's dispatch when every gate is equal,
plain top-k when no group is excluded) and the properties that define each answer: an expert keeps at most its
capacity and never drops a higher gate than it keeps; a token's experts lie in the best groups.
"""

import pytest
import torch
from grading import load

from minidist.model.moe.dispatch import expert_capacity, plan_dispatch
from minidist.model.moe.routing import load_balancing_loss, route, top_k_indices

MODULE = "ch06_moe"
pytestmark = pytest.mark.usefixtures("one_thread")


def _routing(batch: int, seq: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(batch, seq, n, generator=g, dtype=torch.float64) * 2).softmax(-1)
    return probs, top_k_indices(probs, k)


# ------------------------------------------------------------------------------------------------------------------
# sequence-wise balance loss


def _loss_hint(got: float, probs: torch.Tensor, indices: torch.Tensor, n: int) -> str:
    k = indices.shape[-1]
    per_sequence = [load_balancing_loss(p, i, n).item() for p, i in zip(probs, indices)]
    expected = sum(per_sequence) / len(per_sequence)
    batch_wise = load_balancing_loss(probs.reshape(-1, n), indices.reshape(-1, k), n).item()
    variants = {"the batch-wise loss: compute f and P for each sequence, then average the losses": batch_wise,
                "the sum over sequences: average them": sum(per_sequence),
                f"k = {k} times too large: f_i counts slots, divide by T·k so that Σ f_i = 1": expected * k,
                f"k = {k} times too small: f_i = (slots to i) / (T·k), not / (T·k²)": expected / k}
    return next((f" — {why}" for why, v in variants.items() if abs(got - v) < 1e-9 * max(1, abs(v))), "")


@pytest.mark.parametrize("batch", [1, 4])
def test_ch06_sequence_balance_loss_value(impl: str, batch: int) -> None:
    sequence_balance_loss = load(impl, MODULE, "sequence_balance_loss")
    n, k = 8, 2
    probs, indices = _routing(batch, 16, n, k, seed=batch)
    got = sequence_balance_loss(probs, indices, n)
    expected = sum(load_balancing_loss(p, i, n) for p, i in zip(probs, indices)) / batch
    assert torch.is_tensor(got) and got.dim() == 0, "sequence_balance_loss must return a scalar tensor"
    assert abs(got.item() - expected.item()) < 1e-9, (
        f"sequence_balance_loss(B={batch}, T=16, N={n}, k={k}): got {got.item():.6f}, expected "
        f"{expected.item():.6f} (the mean over sequences of N·Σ f_i·P_i){_loss_hint(got.item(), probs, indices, n)}")


def test_ch06_sequence_balance_loss_gradient(impl: str) -> None:
    sequence_balance_loss = load(impl, MODULE, "sequence_balance_loss")
    n, k = 8, 2
    probs, indices = _routing(3, 16, n, k, seed=5)
    probs.requires_grad_()
    sequence_balance_loss(probs, indices, n).backward()
    got = probs.grad.clone()
    probs.grad = None
    (sum(load_balancing_loss(p, i, n) for p, i in zip(probs, indices)) / 3).backward()
    close = torch.allclose(got, probs.grad, rtol=0, atol=1e-12)
    assert close, ("sequence_balance_loss: its gradient with respect to probs is wrong — P_i (the mean probability) "
                   "carries the gradient, f_i is a count and carries none")


def test_ch06_sequence_balance_loss_uniform_and_split(impl: str) -> None:
    sequence_balance_loss = load(impl, MODULE, "sequence_balance_loss")
    n, k, seq = 4, 2, 8
    _, indices = _routing(3, seq, n, k, seed=7)
    uniform = torch.full((3, seq, n), 1 / n, dtype=torch.float64)
    got = sequence_balance_loss(uniform, indices, n).item()
    assert abs(got - 1) < 1e-12, (f"sequence_balance_loss with uniform probabilities: got {got}, expected exactly 1 "
                                  "(N·Σ f_i/N = Σ f_i = 1 in every sequence)")
    # Sequence 0 sends every token to experts {0, 1}, sequence 1 to {2, 3}: balanced over the batch, collapsed in
    # each sequence.
    probs = torch.zeros(2, seq, n, dtype=torch.float64)
    probs[0, :, :2] = probs[1, :, 2:] = 0.5
    split = torch.stack((torch.tensor([[0, 1]] * seq), torch.tensor([[2, 3]] * seq)))
    batch_wise = load_balancing_loss(probs.reshape(-1, n), split.reshape(-1, k), n).item()
    got = sequence_balance_loss(probs, split, n).item()
    assert abs(batch_wise - 1) < 1e-12 and abs(got - n / k) < 1e-12, (
        f"sequence_balance_loss: two sequences that each use only 2 of 4 experts (but all 4 together) give {got}, "
        f"expected N/k = {n / k}; the batch-wise loss of the same batch is {batch_wise}")


# ------------------------------------------------------------------------------------------------------------------
# dropping by score


def _check_kept(keep: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor, n: int, capacity: int, where: str):
    num_tokens, k = indices.shape
    assert keep.shape == indices.shape and keep.dtype == torch.bool, \
        f"{where}: returned {tuple(keep.shape)} {keep.dtype}, expected a bool mask of shape {tuple(indices.shape)}"
    slot = torch.arange(k)[None, :] * num_tokens + torch.arange(num_tokens)[:, None]  # r·T + t
    for e in range(n):
        mine = indices == e
        kept, dropped = mine & keep, mine & ~keep
        routed = int(mine.sum())
        assert int(kept.sum()) == min(routed, capacity), (
            f"{where}: expert {e} was chosen by {routed} slots and keeps {int(kept.sum())}; it must keep "
            f"min(routed, capacity) = {min(routed, capacity)}")
        if kept.any() and dropped.any():
            lowest_kept, highest_dropped = gates[kept].min().item(), gates[dropped].max().item()
            assert lowest_kept >= highest_dropped, (
                f"{where}: expert {e} keeps a slot with gate {lowest_kept:.4f} but drops one with {highest_dropped:.4f}"
                " — keep the highest gates")
            tie = gates[kept].min()
            if (gates[dropped] == tie).any():
                assert slot[kept & (gates == tie)].max() < slot[dropped & (gates == tie)].min(), (
                    f"{where}: expert {e} breaks a tie of gates {tie.item():.4f} against the lower slot number; "
                    "among equal gates the slot r·T + t that comes first wins (first choices, then earlier tokens)")


def test_ch06_drop_by_score_keeps_the_highest_gates(impl: str) -> None:
    drop_by_score = load(impl, MODULE, "drop_by_score")
    n, k, num_tokens = 8, 2, 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(num_tokens, n, generator=g) + torch.linspace(1.0, 0.0, n)  # some experts overloaded
    routing = route(logits, k, "softmax")
    capacity = expert_capacity(num_tokens, n, k, 1.0)
    keep = drop_by_score(routing.indices, routing.weights, n, capacity)
    _check_kept(keep, routing.indices, routing.weights, n, capacity, f"drop_by_score(T={num_tokens}, N={n}, k={k}, "
                                                                     f"capacity {capacity})")
    assert not keep.all(), "the grader's case should drop some slots"


def test_ch06_drop_by_score_ties(impl: str) -> None:
    drop_by_score = load(impl, MODULE, "drop_by_score")
    n, k, num_tokens = 4, 2, 24
    g = torch.Generator().manual_seed(1)
    indices = top_k_indices(torch.randn(num_tokens, n, generator=g), k)
    # Gates on a coarse grid: many ties, including at the capacity boundary.
    gates = torch.randint(1, 4, (num_tokens, k), generator=g).float() / 4
    keep = drop_by_score(indices, gates, n, 5)
    _check_kept(keep, indices, gates, n, 5, "drop_by_score(gates with ties, capacity 5)")
    # With all gates equal, dropping by score is GShard's rule, which minidist's plan_dispatch implements.
    equal = torch.ones(num_tokens, k)
    keep = drop_by_score(indices, equal, n, 5)
    plan = plan_dispatch(indices, equal, n, 5)
    gshard = torch.zeros(k * num_tokens, dtype=torch.bool)
    gshard[plan.slot] = True
    same = torch.equal(keep, gshard.view(k, num_tokens).t())
    assert same, ("drop_by_score(all gates equal, capacity 5): differs from GShard's priority (minidist's "
                  "plan_dispatch) — with equal gates, every first choice comes before any second choice, then the "
                  "earlier token")


def test_ch06_drop_by_score_large_capacity_keeps_all(impl: str) -> None:
    drop_by_score = load(impl, MODULE, "drop_by_score")
    routing = route(torch.randn(16, 4, generator=torch.Generator().manual_seed(2)), 2, "softmax")
    keep = drop_by_score(routing.indices, routing.weights, 4, 32)
    assert keep.all(), "drop_by_score with capacity 32 ≥ all 32 slots must keep every slot"


# ------------------------------------------------------------------------------------------------------------------
# group-limited routing


def test_ch06_group_limited_top_k_without_a_limit_is_top_k(impl: str) -> None:
    group_limited_top_k = load(impl, MODULE, "group_limited_top_k")
    scores = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    got = group_limited_top_k(scores, 4, 4, 4)
    same = torch.equal(got, top_k_indices(scores, 4))
    assert same, ("group_limited_top_k(top_groups = n_groups = 4): with every group allowed it must be plain top-k "
                  "(best first; equal scores: lower expert index first)")


@pytest.mark.parametrize("sign", ["sigmoid scores", "raw logits (negative too)"])
def test_ch06_group_limited_top_k_properties(impl: str, sign: str) -> None:
    group_limited_top_k = load(impl, MODULE, "group_limited_top_k")
    num_tokens, n, n_groups, top_groups, k = 64, 16, 4, 2, 4
    scores = torch.randn(num_tokens, n, generator=torch.Generator().manual_seed(4))
    scores = scores.sigmoid() if sign == "sigmoid scores" else scores - 1.0
    got = group_limited_top_k(scores, k, n_groups, top_groups)
    where = f"group_limited_top_k({sign}, N={n}, {n_groups} groups, best {top_groups}, k={k})"
    assert got.shape == (num_tokens, k), f"{where}: shape {tuple(got.shape)}, expected ({num_tokens}, {k})"
    size = n // n_groups
    two_best = scores.view(num_tokens, n_groups, size).sort(dim=-1, descending=True).values[..., :2].sum(-1)
    for t in range(num_tokens):
        chosen = got[t]
        groups = set((chosen // size).tolist())
        best = set(two_best[t].argsort(descending=True)[:top_groups].tolist())
        assert len(set(chosen.tolist())) == k, f"{where}: token {t} got experts {chosen.tolist()}, not {k} distinct"
        assert groups <= best, (
            f"{where}: token {t} chose experts {chosen.tolist()} in groups {sorted(groups)}, but the best groups "
            f"by the sum of their two highest scores are {sorted(best)}")
        values = scores[t, chosen]
        assert bool((values[1:] <= values[:-1]).all()), f"{where}: token {t}'s experts must come best first"
        allowed = torch.tensor([e // size in best for e in range(n)])
        others = allowed.clone()
        others[chosen] = False
        assert not (scores[t][others] > values.min()).any(), (
            f"{where}: token {t} skipped an expert of an allowed group with a higher score than one it chose — "
            "inside the allowed groups, take the plain top-k (mask the other groups with -inf, not 0)")


def test_ch06_group_limited_top_k_uses_two_best_per_group(impl: str) -> None:
    group_limited_top_k = load(impl, MODULE, "group_limited_top_k")
    # Group 0 holds the single best expert (0.99) but nothing else; group 1's two best sum to 1.2 > 0.99.
    scores = torch.tensor([[0.99, 0.0, 0.0, 0.0, 0.6, 0.6, 0.1, 0.1]])
    got = sorted(group_limited_top_k(scores, 2, 2, 1)[0].tolist())
    assert got == [4, 5], (f"group_limited_top_k: for scores {scores[0].tolist()} in 2 groups of 4, best 1 group, "
                           f"k=2, got experts {got}; a group is ranked by the sum of its two highest scores (group 1: "
                           "0.6 + 0.6), not by its single best")
