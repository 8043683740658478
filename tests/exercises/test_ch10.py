"""Grade chapter 10's exercises: the online-softmax merge of two partial attention results, and the zig-zag split
of a sequence over context-parallel ranks with its inverse.

`pytest tests/exercises -k ch10` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=10`). The oracles are the chapter's own: softmax attention over the union of the keys computed
directly in fp64, the zig-zag table of §3 (T = 16, cp = 4) and the definition of the split (chunks r and
2·cp − 1 − r of 2·cp), never the reference answers.
"""

import importlib

import pytest
import torch

MODULE = "ch10_context"


def _load(impl: str, name: str):
    """`impl.ch10_context.name`; an unanswered stub fails the test in one line instead of a traceback."""
    fn = getattr(importlib.import_module(f"{impl}.{MODULE}"), name)

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            pytest.fail(f"{impl}.{MODULE}.{name} is not implemented yet", pytrace=False)

    return call


# ---------------------------------------------------------------------------------------------------------------
# merge_partials
# ---------------------------------------------------------------------------------------------------------------


def _attend(scores: torch.Tensor, v: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the key subset `keys` (bool [S]) and its log-sum-exp, directly from the scores (fp64)."""
    s = scores.masked_fill(~keys, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.softmax(s, dim=-1))
    return probs @ v, lse


def _case(scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 5, 12, generator=g, dtype=torch.float64) * scale  # [batch, heads, queries, keys]
    v = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    split = torch.randperm(12, generator=g) < 5  # a random subset A; B is the rest
    return scores, v, split


@pytest.mark.parametrize("case,scale,empty", [
    ("random scores", 1.0, None),
    ("huge scores (e^1000 overflows: weigh by e^(L_A - L), never e^(L_A))", 400.0, None),
    ("block B saw no key (its L is -inf, its output 0)", 1.0, "b"),
    ("both blocks saw no key (L = -inf, output 0, no NaN)", 1.0, "both"),
])
def test_ch10_merge_partials_equals_attention_over_the_union(impl: str, case: str, scale: float, empty) -> None:
    merge_partials = _load(impl, "merge_partials")
    scores, v, in_a = _case(scale, seed=len(case))
    in_b = ~in_a
    if empty == "b":
        in_b = torch.zeros_like(in_a)
    elif empty == "both":
        in_a = in_b = torch.zeros_like(in_a)
    out_a, lse_a = _attend(scores, v, in_a)
    out_b, lse_b = _attend(scores, v, in_b)
    want_out, want_lse = _attend(scores, v, in_a | in_b)
    got_out, got_lse = merge_partials(out_a, lse_a, out_b, lse_b)
    where = f"merge_partials, {case}"
    assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape, \
        f"{where}: shapes {tuple(got_out.shape)}, {tuple(got_lse.shape)}; expected {tuple(want_out.shape)} and " \
        f"{tuple(want_lse.shape)} (the output keeps the head dimension, the log-sum-exp drops it)"
    broken = ~torch.isfinite(got_out).all() or torch.isnan(got_lse).any() or torch.isposinf(got_lse).any()
    if broken and scale > 1:
        pytest.fail(f"{where}: inf or NaN in the result — e^(L_A) itself overflowed (L_A is about "
                    f"{lse_a.max().item():.0f}; e^710 is already inf in fp64): never exponentiate a log-sum-exp "
                    "alone, weigh by e^(L_A − L) ≤ 1 with L = torch.logaddexp(L_A, L_B)", pytrace=False)
    if broken:
        pytest.fail(f"{where}: inf or NaN in the result — an exp of inf − inf where a block saw no key? Give a "
                    "block with L = −inf the weight 0, and return L = −inf, out = 0 when both are empty", pytrace=False)
    if not torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)) or not torch.allclose(
            got_lse.nan_to_num(neginf=0), want_lse.nan_to_num(neginf=0), rtol=1e-12, atol=1e-12):
        pytest.fail(f"{where}: log-sum-exp differs from log Σ exp(s) over both blocks (max error "
                    f"{(got_lse - want_lse).nan_to_num().abs().max().item():.2e}) — L = log(e^L_A + e^L_B)",
                    pytrace=False)
    if not torch.allclose(got_out, want_out, rtol=1e-12, atol=1e-12):
        unweighted = (out_a + out_b) / 2
        hint = (" — the plain average of the two outputs: weigh each by its share e^(L_X - L) of the softmax "
                "denominator" if torch.allclose(got_out, unweighted) else
                " — each output is already normalized over its own block: multiply by e^(L_X - L), the share of "
                "its block in the union's denominator")
        pytest.fail(f"{where}: output differs from softmax attention over the union by up to "
                    f"{(got_out - want_out).abs().max().item():.2e}{hint}", pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# The zig-zag split
# ---------------------------------------------------------------------------------------------------------------

TABLE_T16_CP4 = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}  # chapter 10, §3


def test_ch10_zigzag_shard_index_gives_the_chapter_table(impl: str) -> None:
    shard = _load(impl, "zigzag_shard_index")
    for rank, want in TABLE_T16_CP4.items():
        got = shard(16, 4, rank)
        got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        if got != want:
            hint = ""
            if sorted(got) == want:
                hint = " — the right positions in the wrong order: chunk r first, then chunk 2·cp − 1 − r"
            elif got == list(range(rank * 4, rank * 4 + 4)):
                hint = " — that is the contiguous split; zig-zag takes chunks r and 2·cp − 1 − r of 2·cp chunks"
            elif len(got) != 4:
                hint = f" — {len(got)} positions; each rank holds T/cp = 4"
            pytest.fail(f"zigzag_shard_index(16, cp=4, rank={rank}) = {got}, expected {want}{hint}", pytrace=False)


@pytest.mark.parametrize("seq_len,cp", [(8, 1), (12, 2), (48, 3), (64, 4), (160, 8)])
def test_ch10_zigzag_split_is_a_balanced_partition(impl: str, seq_len: int, cp: int) -> None:
    shard = _load(impl, "zigzag_shard_index")
    chunk = seq_len // (2 * cp)
    held = [torch.as_tensor(shard(seq_len, cp, r)).long() for r in range(cp)]
    for r, positions in enumerate(held):
        first, second = r, 2 * cp - 1 - r
        want = list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))
        assert positions.tolist() == want, \
            f"zigzag_shard_index({seq_len}, cp={cp}, rank={r}): {positions.tolist()}, expected chunks {first} and " \
            f"{second} of {2 * cp} (chunk size {chunk}): {want}"
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len)), \
        f"T={seq_len}, cp={cp}: the ranks' positions together must be every position exactly once"
    work = [int((p + 1).sum()) for p in held]  # query t scores t + 1 keys under the causal mask
    assert max(work) == min(work), f"T={seq_len}, cp={cp}: unequal causal work per rank {work}"


@pytest.mark.parametrize("seq_len,cp", [(16, 4), (12, 2), (48, 3), (160, 8)])
def test_ch10_zigzag_unshard_index_restores_the_order(impl: str, seq_len: int, cp: int) -> None:
    unshard = _load(impl, "zigzag_unshard_index")
    chunk = seq_len // (2 * cp)
    # The shards laid end to end, built from the definition (not from your shard function).
    held = torch.cat([torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (r, 2 * cp - 1 - r)])
                      for r in range(cp)])
    inv = torch.as_tensor(unshard(seq_len, cp)).long()
    where = f"zigzag_unshard_index({seq_len}, cp={cp})"
    assert inv.shape == (seq_len,), f"{where}: shape {tuple(inv.shape)}, expected ({seq_len},)"
    if not torch.equal(held[inv], torch.arange(seq_len)):
        hint = (" — that is the forward map (slot -> position); invert it: inv[held[i]] = i"
                if torch.equal(inv, held) else "")
        pytest.fail(f"{where}: held[inv] = {held[inv].tolist()[:16]}..., expected 0, 1, 2, ...{hint}", pytrace=False)
    if (seq_len, cp) == (16, 4):
        assert inv.tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 14, 15, 10, 11, 6, 7, 2, 3], f"{where}: the chapter's example"
    data = torch.randn(3, seq_len, 2)  # any tensor: the same index restores its sequence dimension
    assert torch.equal(data[:, held][:, inv], data), f"{where}: does not restore a [3, T, 2] tensor along dim 1"


# ---------------------------------------------------------------------------------------------------------------
# ring_attention, on 3 real ranks: one launch runs every case
# ---------------------------------------------------------------------------------------------------------------

RING_WORLD = 3
# (case name, seq_len, batch, heads, head_dim, score scale): the last makes e^(score) overflow unless the merge is
# done in log space.
RING_CASES = [("T=12, 1x2 heads, d=4", 12, 1, 2, 4, 1.0), ("T=24, 2x3 heads, d=8", 24, 2, 3, 8, 1.0),
              ("T=6, one token per chunk", 6, 1, 1, 4, 1.0), ("huge scores (q scaled by 60)", 18, 1, 2, 4, 60.0)]
# isend/irecv stay unwrapped: dist.P2POp accepts only those very functions.
RECORDED = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast", "send", "recv",
            "batch_isend_irecv")


def _zigzag(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """From the definition: chunks r and 2·cp − 1 − r of 2·cp (the grader's own, not your zigzag_shard_index)."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in (rank, 2 * cp - 1 - rank)])


def _qkv(seq_len: int, batch: int, heads: int, dim: int, scale: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq_len * 100 + heads)
    q, k, v = (torch.randn(batch, heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(3))
    return q * scale, k, v


def ring_worker(impl: str) -> dict:
    """On every rank: each case's output for this rank's shard, and which torch.distributed calls the answer made."""
    import torch.distributed as dist

    fn = importlib.import_module(f"{impl}.{MODULE}").ring_attention
    rank, cp = dist.get_rank(), dist.get_world_size()
    calls: set[str] = set()
    originals = {name: getattr(dist, name) for name in RECORDED}

    def recording(name):
        def call(*args, **kwargs):
            calls.add(name)
            return originals[name](*args, **kwargs)
        return call

    outputs = []
    result: dict = {"missing": False}
    try:
        for name in RECORDED:
            setattr(dist, name, recording(name))
        for _, seq_len, batch, heads, dim, scale in RING_CASES:
            mine = _zigzag(seq_len, cp, rank)
            q, k, v = (t[:, :, mine].contiguous() for t in _qkv(seq_len, batch, heads, dim, scale))
            out = fn(q, k, v, seq_len)
            outputs.append(None if out is None else out.detach().clone())
    except NotImplementedError:
        result["missing"] = True
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    result.update(outputs=outputs, calls=sorted(calls), ulysses=_ulysses_cases(impl, rank, cp))
    return result


def _ulysses_cases(impl: str, rank: int, cp: int) -> list[dict] | None:
    """Every Ulysses case on this rank: the output and the gradients of q, k, v; None when not implemented."""
    fn = importlib.import_module(f"{impl}.{MODULE}").ulysses_attention
    results = []
    try:
        for _, seq_len, batch, heads, dim in ULYSSES_CASES:
            mine = slice(rank * seq_len // cp, (rank + 1) * seq_len // cp)
            q, k, v = (t[:, :, mine].clone().requires_grad_(True) for t in _qkv(seq_len, batch, heads, dim, 1.0))
            out = fn(q, k, v)
            (out * _probe(seq_len, batch, heads, dim)[:, :, mine]).sum().backward()
            results.append({"out": out.detach(), **{f"d{n}": (None if t.grad is None else t.grad.clone())
                                                     for n, t in zip("qkv", (q, k, v))}})
    except NotImplementedError:
        return None
    except Exception as error:  # noqa: BLE001  (every rank raises alike here: report it per case, not as a crash)
        return [{"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}] * len(ULYSSES_CASES)
    return results


ULYSSES_CASES = [("T=12, 3 heads, d=4", 12, 1, 3, 4), ("T=24, 2x6 heads, d=8", 24, 2, 6, 8),
                 ("T=3, one token per rank", 3, 1, 3, 4)]


def _probe(seq_len: int, batch: int, heads: int, dim: int) -> torch.Tensor:
    """The gradient of the output the graders back-propagate: loss = Σ out · probe."""
    return torch.randn(batch, heads, seq_len, dim, generator=torch.Generator().manual_seed(seq_len + 7),
                       dtype=torch.float64)


@pytest.fixture(scope="module")
def ring(impl: str) -> list[dict]:
    from minidist.comm.launch import run_ranks
    case = (f"world {RING_WORLD}: {impl}.{MODULE}.ring_attention on {len(RING_CASES)} zig-zag cases and "
            f"ulysses_attention on {len(ULYSSES_CASES)} contiguous ones (fp64)")
    return run_ranks(ring_worker, RING_WORLD, impl, timeout=90, threads_per_rank=1, case=case)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _ring_hint(got: torch.Tensor, q, k, v, rank: int, cp: int) -> str:
    """Name the slip whose result `got` reproduces."""
    seq_len = q.shape[2]
    mine = _zigzag(seq_len, cp, rank)
    qm = q[:, :, mine]
    positions = torch.arange(seq_len)
    held = torch.cat([_zigzag(seq_len, cp, r) for r in range(cp)])  # slot i (rank-major) holds position held[i]
    assumed = torch.empty(seq_len, dtype=torch.long)
    assumed[held] = torch.arange(seq_len)  # the position a contiguous reading gives each true position
    wrong = {
        "there is no causal mask: every query saw every key (a key is visible when its position ≤ the query's)":
            torch.ones(len(mine), seq_len, dtype=torch.bool),
        "only this rank's own keys were used: the K/V blocks never went around the ring (or the received block "
        "was never used)": torch.isin(positions, mine)[None, :] & (positions[None, :] <= mine[:, None]),
        "the mask assumed a contiguous split (rank r holds [r·T/cp, (r+1)·T/cp)): under zig-zag, rank r holds "
        "chunks r and 2·cp − 1 − r": assumed[None, :] <= assumed[mine][:, None],
    }
    for cause, allowed in wrong.items():
        if torch.allclose(got, _masked(qm, k, v, allowed), rtol=1e-9, atol=1e-9):
            return f" — {cause}"
    return (" — check which rank the block you hold came from (after s hops to the right it is rank − s's) and "
            "mask it with that rank's zig-zag positions; fold each block in with the online-softmax merge")


@pytest.mark.parametrize("index", range(len(RING_CASES)), ids=[c[0] for c in RING_CASES])
def test_ch10_ring_attention_equals_causal_attention_on_the_gathered_sequence(ring: list[dict], impl: str,
                                                                            index: int) -> None:
    if any(r["missing"] for r in ring):
        pytest.fail(f"{impl}.{MODULE}.ring_attention is not implemented yet", pytrace=False)
    name, seq_len, batch, heads, dim, scale = RING_CASES[index]
    q, k, v = _qkv(seq_len, batch, heads, dim, scale)
    want_all = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank, result in enumerate(ring):
        got = result["outputs"][index]
        mine = _zigzag(seq_len, RING_WORLD, rank)
        want = want_all[:, :, mine]
        where = f"ring_attention, world {RING_WORLD}, rank {rank}, case {name!r}"
        assert got is not None and got.shape == want.shape, \
            f"{where}: returned {None if got is None else tuple(got.shape)}, expected {tuple(want.shape)}"
        if torch.isnan(got).any():
            cause = ("e^(score) or e^(L) overflowed to inf: keep the merge in log space, weigh by e^(L_X − L)"
                     if scale > 1 else "a fully masked row or block (log-sum-exp −inf) produced inf − inf: give "
                     "it weight 0, or skip a block no query can see")
            pytest.fail(f"{where}: NaN in the output — {cause}", pytrace=False)
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
            pytest.fail(f"{where}: differs from causal SDPA on the gathered sequence by up to "
                        f"{(got - want).abs().max().item():.2e}{_ring_hint(got, q, k, v, rank, RING_WORLD)}",
                        pytrace=False)


def test_ch10_ring_attention_passes_blocks_between_neighbours(ring: list[dict], impl: str) -> None:
    if any(r["missing"] for r in ring):
        pytest.fail(f"{impl}.{MODULE}.ring_attention is not implemented yet", pytrace=False)
    for rank, result in enumerate(ring):
        gathered = [c for c in result["calls"] if c.startswith(("all_", "broadcast"))]
        assert not gathered, (
            f"ring_attention, rank {rank}: called dist.{', dist.'.join(gathered)} — that gathers the whole sequence "
            "onto every rank, the memory ring attention exists to avoid; pass one K/V block to the next rank per step")
        assert set(result["calls"]) & {"isend", "irecv", "send", "recv", "batch_isend_irecv"}, (
            f"ring_attention, rank {rank}: no point-to-point call at all — the K/V blocks must travel around the ring")



@pytest.mark.parametrize("index", range(len(ULYSSES_CASES)), ids=[c[0] for c in ULYSSES_CASES])
def test_ch10_ulysses_attention_forward_and_gradients(ring: list[dict], impl: str, index: int) -> None:
    if any(r["ulysses"] is None for r in ring):
        pytest.fail(f"{impl}.{MODULE}.ulysses_attention is not implemented yet", pytrace=False)
    name, seq_len, batch, heads, dim = ULYSSES_CASES[index]
    q, k, v = (t.requires_grad_(True) for t in _qkv(seq_len, batch, heads, dim, 1.0))
    want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    (want_out * _probe(seq_len, batch, heads, dim)).sum().backward()
    for rank, result in enumerate(ring):
        got = result["ulysses"][index]
        mine = slice(rank * seq_len // RING_WORLD, (rank + 1) * seq_len // RING_WORLD)
        where = f"ulysses_attention, world {RING_WORLD}, rank {rank}, case {name!r}"
        if "error" in got:
            hint = (" — the output is cut off from q, k, v: autograd cannot see through dist.all_to_all_single; wrap "
                    "each exchange in a torch.autograd.Function" if "require grad" in got["error"] else
                    " — a backward that returns the wrong shape? The adjoint of an exchange is the reverse exchange"
                    if "gradient" in got["error"] or "shape" in got["error"] else "")
            pytest.fail(f"{where}: raised {got['error']}{hint}", pytrace=False)
        want = want_out[:, :, mine].detach()
        assert got["out"].shape == want.shape, \
            f"{where}: output {tuple(got['out'].shape)}, expected {tuple(want.shape)}"
        if not torch.allclose(got["out"], want, rtol=1e-9, atol=1e-9):
            local = torch.nn.functional.scaled_dot_product_attention(*(t[:, :, mine] for t in (q, k, v)),
                                                                     is_causal=True).detach()
            full = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, :, mine].detach()
            hint = (" — attention over this rank's own tokens only: the first all-to-all must give every rank all "
                    "T tokens of its H/cp heads" if torch.allclose(got["out"], local) else
                    " — no causal mask: after the exchange the sequence is whole and in order, use is_causal=True"
                    if torch.allclose(got["out"], full) else
                    " — check which chunk goes where: chunk j of the heads to rank j, received chunks laid end to "
                    "end in rank order along the sequence")
            pytest.fail(f"{where}: differs from causal SDPA on the gathered sequence by up to "
                        f"{(got['out'] - want).abs().max().item():.2e}{hint}", pytrace=False)
        for n, t in zip("qkv", (q, k, v)):
            grad = got[f"d{n}"]
            if grad is None:
                pytest.fail(f"{where}: {n}.grad is None — autograd cannot see through dist.all_to_all_single: wrap "
                            "each exchange in a torch.autograd.Function", pytrace=False)
            if not torch.allclose(grad, t.grad[:, :, mine], rtol=1e-9, atol=1e-9):
                pytest.fail(f"{where}: d{n} differs from the one-device gradient by up to "
                            f"{(grad - t.grad[:, :, mine]).abs().max().item():.2e} — the adjoint of an exchange is "
                            "the reverse exchange: heads back to the sequence for the first, sequence back to heads "
                            "for the second", pytrace=False)
