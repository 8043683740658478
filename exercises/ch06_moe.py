"""Chapter 06 exercises: the sequence-wise balance loss, dropping by score, and group-limited routing.

Grade your answers with `make grade CH=06`. The grader compares with `minidist.model.moe` where it has an answer
(the batch-wise loss of each sequence, GShard's dispatch when every gate is equal, plain top-k when no group is
excluded) and checks the properties that define each answer where it has none.

Shapes as in `minidist.model.moe`: T tokens, N experts, top-k routing; `indices` [T, k] (or [B, T, k]) holds the
chosen experts of each token, best first; slot r·T + t is the r-th choice of token t.
"""

import torch


def sequence_balance_loss(probs: torch.Tensor, indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (DeepSeek-V3 Technical Report, §2.1.2, eq. 17-20), unweighted.

    probs [B, T, N]: each token's router distribution (rows sum to 1); indices [B, T, k]: its chosen experts.
    Switch's batch-wise loss (eq. 4-6) is N·Σ_i f_i·P_i over all tokens of the batch. minidist's MoELayer computes
    f and P *per sequence* b (notebook 06, §2, says why: the loss must not depend on how a batch is split),
        f_i^b = (slots of sequence b routed to i) / (T·k),      P_i^b = mean over the T tokens of b of probs[..., i],
    and the loss is the mean over sequences of N·Σ_i f_i^b·P_i^b. Return a scalar tensor; the gradient flows
    through P only (f is a count).

    Why: a batch can look balanced while every sequence uses only a few experts (e.g. code to some, prose to
    others), which under expert parallelism still overloads devices sequence by sequence. Check on paper: with
    N = 4, k = 2, one sequence routed entirely to experts {0, 1} (probabilities 1/2 each) and another to {2, 3},
    the batch-wise loss is 1 and the sequence-wise loss is N/k = 2. Uniform probabilities give exactly 1.

    Hints: torch.nn.functional.one_hot(indices, n_experts).sum(dim=(1, 2)) counts slots per sequence and expert;
    with B = 1 the result must equal minidist.model.moe.routing.load_balancing_loss.
    """
    raise NotImplementedError("exercise: the Switch balance loss computed per sequence, then averaged")


def drop_by_score(indices: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which token-slots survive when each expert keeps the `capacity` slots with the *highest gates*.

    indices, gates [T, k], the T tokens of one sequence (minidist's capacity is per sequence); returns a bool mask
    [T, k], True for a kept slot. minidist (like GShard) keeps slots in priority order instead: all first choices
    before any second choice, earlier tokens first, so a confident second choice can lose its place to a weak
    first choice. Here, per expert:
      - keep min(routed, capacity) of the slots routed to it;
      - never drop a slot whose gate is higher than one kept;
      - among equal gates, the lower slot number r·T + t wins (so with all gates equal this *is* GShard's rule —
        the grader checks it against minidist.model.moe.dispatch.plan_dispatch).

    One way, without a Python loop over tokens: flatten the slots in slot order (indices.t().reshape(-1), the same
    for gates); sort them by gate, descending, with a *stable* sort (ties keep slot order); then stable-sort that
    order by expert, so each expert's slots form one run, best first. A slot's rank inside its run is its position
    minus the run's start (torch.bincount and cumsum give the starts); keep the ranks below capacity, and map the
    kept slot numbers back to [T, k].

    Hint: torch.argsort(x, stable=True) only sorts ascending; sort by -gate for "highest first".
    """
    raise NotImplementedError("exercise: per expert, keep the capacity highest gates (ties: lower slot first)")


def group_limited_top_k(scores: torch.Tensor, k: int, n_groups: int, top_groups: int) -> torch.Tensor:
    """DeepSeek-V3's node-limited routing (§2.1.2): choose top_k experts inside the `top_groups` best groups.

    scores [T, N]: each token's selection scores (sigmoid scores plus the balancing bias, or any real numbers —
    they may be negative). The N experts form n_groups consecutive groups of N / n_groups (on a cluster, one group
    per node), at least 2 per group. For each token:
      1. score each group by the sum of its two highest expert scores;
      2. keep the top_groups best groups (equal group scores: the lower group index first);
      3. return the k best experts among the kept groups' experts, best first (equal scores: lower index first),
         as an int64 tensor [T, k].
    So each token's experts live on at most top_groups nodes, which bounds its all-to-all traffic. With
    top_groups == n_groups this is plain top-k (minidist.model.moe.routing.top_k_indices).

    Hints: scores.view(T, n_groups, N // n_groups).topk(2, dim=-1) gives each group's two best; build a [T, N]
    mask of allowed experts (repeat_interleave the group mask) and fill the others with -inf — not 0, because a
    real score can be negative; a stable descending torch.sort keeps the tie rule.
    """
    raise NotImplementedError("exercise: pick the best groups by their two best scores, then top-k inside them")
