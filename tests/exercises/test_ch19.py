"""Grade chapter 19's exercises: the forward's tile loop, the backward of one key/value tile, and the causal key
range of a query tile.

`pytest tests/exercises -k ch19` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=19`). The oracles: softmax over the whole score matrix and torch's autograd through it, and a
brute-force list of the key tiles that hold a visible key. A wrong answer is compared with the plausible wrong
answers written here (a missed rescale, D from this tile's P instead of the final O, a diagonal tile skipped, ...)
and the hint names the one it equals.
"""

import pytest
import torch
from grading import load

MODULE = "ch19_attention_kernel"
TOL = 1e-9  # float64 throughout: any real slip is many orders larger


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and torch.allclose(a, b, rtol=0, atol=TOL * 10)


def check(ok: bool, message: str) -> None:
    """Fail with the message alone (no dump of the tensors compared)."""
    if not ok:
        pytest.fail(message, pytrace=False)


def attention(q, k, v, scale, mask=None):
    s = q @ k.T * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=1) @ v, torch.logsumexp(s, dim=1)


# ---------------------------------------------------------------------------------------------------------------
# 1. The forward's tile loop
# ---------------------------------------------------------------------------------------------------------------


def wrong_forwards(q, k, v, scale, block_n):
    """What a tile loop computes with one slip: {cause: (out, lse)}."""
    found = {}
    for slip in ("acc not rescaled", "l not rescaled", "lse without m", "max of the first tile only"):
        m = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
        total, acc = torch.zeros(q.shape[0], dtype=q.dtype), torch.zeros(q.shape[0], v.shape[1], dtype=q.dtype)
        for start in range(0, k.shape[0], block_n):
            s = q @ k[start:start + block_n].T * scale
            m_new = s.amax(1) if (slip == "max of the first tile only" and start == 0) else torch.maximum(m, s.amax(1))
            if slip == "max of the first tile only" and start > 0:
                m_new = m
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            total = (total if slip == "l not rescaled" else total * alpha) + p.sum(1)
            acc = (acc if slip == "acc not rescaled" else acc * alpha[:, None]) + p @ v[start:start + block_n]
            m = m_new
        found[slip] = (acc / total[:, None], torch.log(total) if slip == "lse without m" else m + torch.log(total))
    return found


HINTS = {"acc not rescaled": "the accumulator was not multiplied by exp(m_old − m_new) when a tile raised the "
                             "maximum (acc = acc·alpha + p @ v)",
         "l not rescaled": "the running sum l was not multiplied by exp(m_old − m_new) when a tile raised the maximum",
         "lse without m": "lse is m + log l: the maximum was subtracted inside the exp, add it back",
         "max of the first tile only": "the running maximum must be updated with every tile "
                                       "(m_new = max(m, this tile's max))"}


def test_ch19_forward_tile_loop_rescales(impl: str) -> None:
    loop = load(impl, MODULE, "forward_tile_loop")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(40, 16, generator=g, dtype=torch.float64)
    k *= torch.arange(1, 41, dtype=torch.float64)[:, None] / 10  # later tiles score higher: each raises the max
    v = torch.randn(40, 8, generator=g, dtype=torch.float64)
    scale, block_n = 16 ** -0.5, 16  # tiles of 16, 16 and a partial 8
    out, lse = loop(q, k, v, scale, block_n)
    want_out, want_lse = attention(q, k, v, scale)
    if close(out, want_out) and close(lse, want_lse):
        return
    causes = [c for c, (o, s) in wrong_forwards(q, k, v, scale, block_n).items() if close(out, o) and close(lse, s)]
    hint = HINTS[causes[0]] if causes else "compare with the online softmax: m, l and acc per row, rescaled by alpha"
    check(close(out, want_out), f"forward_tile_loop: out differs from softmax(q kᵀ·scale) v — {hint}")
    check(close(lse, want_lse), f"forward_tile_loop: lse differs from logsumexp of the scores — {hint}")


def test_ch19_forward_tile_loop_partial_tile_and_block_size(impl: str) -> None:
    loop = load(impl, MODULE, "forward_tile_loop")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (5, 23, 23))
    want_out, want_lse = attention(q, k, v, 0.3)
    for block_n in (4, 8, 32):
        out, lse = loop(q, k, v, 0.3, block_n)
        check(close(out, want_out) and close(lse, want_lse), (
            f"forward_tile_loop with block_n={block_n} over 23 keys differs — walk range(0, N, block_n) and take "
            "k[start:start + block_n] (the last tile is shorter), without assuming N is a multiple"))


def test_ch19_forward_tile_loop_masked_first_tile(impl: str) -> None:
    loop = load(impl, MODULE, "forward_tile_loop")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (4, 24, 24))
    mask = torch.ones(4, 24, dtype=torch.bool)
    mask[2:, :16] = False  # rows 2, 3 see nothing in the first two tiles of 8: a document starting at key 16
    out, lse = loop(q, k, v, 0.5, 8, mask)
    want_out, want_lse = attention(q, k, v, 0.5, mask)
    check(bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), (
        "forward_tile_loop: NaN for rows whose first tiles are all masked — their maximum is still −inf, and "
        "exp(−inf − (−inf)) is NaN: subtract 0 instead while the maximum is −inf"))
    check(close(out, want_out) and close(lse, want_lse),
          "forward_tile_loop with a mask: apply it as −inf scores before the tile's max")


# ---------------------------------------------------------------------------------------------------------------
# 2. The backward of one key/value tile
# ---------------------------------------------------------------------------------------------------------------


def wrong_backward(slip, q, k, v, out, dout, lse, scale):
    s = q @ k.T * scale
    p = torch.softmax(s, 1) if slip == "P normalized over this tile" else torch.exp(s - lse[:, None])
    delta = (dout * (p @ v)).sum(1) if slip == "D from this tile's P" else (dout * out).sum(1)
    ds = p * (dout @ v.T - delta[:, None])
    factor = 1.0 if slip == "scale missing" else scale
    return ds @ k * factor, ds.T @ q * factor, p.T @ dout


BACKWARD_HINTS = {
    "D from this tile's P": "D was computed from this tile's P V (a partial output); D = rowsum(dO ∘ O) needs the "
                            "final O over all keys, which is what makes one tile's dS right",
    "P normalized over this tile": "P was normalized over this tile's keys; P = exp(q kᵀ·scale − lse) with the "
                                   "final lse is this tile's block of the full softmax",
    "scale missing": "dQ and dK carry the scale (the scores were q kᵀ·scale): dQ = dS K·scale, dK = dSᵀ Q·scale"}


def test_ch19_kv_tile_backward_sums_to_autograd(impl: str) -> None:
    backward = load(impl, MODULE, "kv_tile_backward")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(12, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    scale = 0.25
    out, lse = attention(q, k, v, scale)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(out, (q, k, v), dout)
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    tiles = [slice(0, 16), slice(16, 32), slice(32, 40)]  # the last one partial
    got = [backward(q, k[t], v[t], out, dout, lse, scale) for t in tiles]
    dq = sum(part[0] for part in got)
    dk, dv = torch.cat([part[1] for part in got]), torch.cat([part[2] for part in got])
    if close(dq, want[0]) and close(dk, want[1]) and close(dv, want[2]):
        return
    slips = [[wrong_backward(slip, q, k[t], v[t], out, dout, lse, scale) for t in tiles] for slip in BACKWARD_HINTS]
    causes = [slip for slip, parts in zip(BACKWARD_HINTS, slips)
              if close(dq, sum(p[0] for p in parts)) and close(dk, torch.cat([p[1] for p in parts]))]
    hint = BACKWARD_HINTS[causes[0]] if causes else "P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D)"
    check(close(dv, want[2]), f"kv_tile_backward: dV differs from autograd's — {hint}")
    check(close(dq, want[0]), f"kv_tile_backward: the tiles' dQ parts do not sum to autograd's dQ — {hint}")
    check(close(dk, want[1]), f"kv_tile_backward: dK differs from autograd's — {hint}")


def test_ch19_kv_tile_backward_one_tile_alone(impl: str) -> None:
    """With a single tile holding every key, D from P and D from O agree: only the multi-tile test can tell them
    apart. Here the shapes: a tile's dK, dV have the tile's rows, dQ's part all the queries'."""
    backward = load(impl, MODULE, "kv_tile_backward")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (3, 6, 6))
    out, lse = attention(q, k, v, 0.5)
    dq, dk, dv = backward(q, k[:2], v[:2], out, torch.ones(3, 4, dtype=torch.float64), lse, 0.5)
    assert (tuple(dq.shape), tuple(dk.shape), tuple(dv.shape)) == ((3, 4), (2, 4), (2, 4)), (
        f"kv_tile_backward: shapes {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)}; want dq [M, D] = (3, 4), "
        "dk [Nt, D] = (2, 4), dv [Nt, Dv] = (2, 4)")


# ---------------------------------------------------------------------------------------------------------------
# 3. The causal key range of a query tile
# ---------------------------------------------------------------------------------------------------------------


def needed_tiles(start_m, block_m, block_n, seq_len, first_key):
    """Starts of the key tiles holding a key some query of the tile may see (first_key <= key <= query)."""
    queries = range(start_m * block_m, min((start_m + 1) * block_m, seq_len))
    return sorted({key // block_n * block_n for key in range(first_key, seq_len) if key <= queries[-1]})


@pytest.mark.parametrize("block_m, block_n, seq_len", [(16, 16, 64), (32, 16, 80), (16, 32, 72), (16, 8, 56)])
@pytest.mark.parametrize("first_key", [0, 20, 37])
def test_ch19_causal_kv_range(impl: str, block_m, block_n, seq_len, first_key) -> None:
    kv_range = load(impl, MODULE, "causal_kv_range")
    for start_m in range(-(-seq_len // block_m)):
        if first_key > start_m * block_m:
            continue  # first_key is where the tile's FIRST query's document starts: at or before that query
        lo, hi = kv_range(start_m, block_m, block_n, seq_len, first_key)
        visited, needed = list(range(lo, hi, block_n)), needed_tiles(start_m, block_m, block_n, seq_len, first_key)
        case = (f"causal_kv_range(start_m={start_m}, block_m={block_m}, block_n={block_n}, seq_len={seq_len}, "
                f"first_key={first_key}) = ({lo}, {hi})")
        assert lo % block_n == 0, f"{case}: lo must start a key tile — round first_key down to a multiple of block_n"
        if visited == needed:
            continue
        last_query = min((start_m + 1) * block_m, seq_len) - 1
        if not visited or visited[-1] < needed[-1]:
            hint = (f"the diagonal tile (keys {needed[-1]}..) is skipped: hi must pass the tile's last query "
                    f"{last_query}" + (" — the query tile is block_m wide, not block_n" if block_m != block_n else ""))
        elif visited and visited[-1] > needed[-1]:
            hint = (f"a tile past the last query {last_query} is visited (keys {visited[-1]}..): stop at the last "
                    "query + 1, and at seq_len")
        elif visited and visited[0] > needed[0]:
            hint = f"the tile holding first_key (keys {needed[0]}..) is skipped: round first_key down, not up"
        else:
            hint = f"tiles before the document's first key are visited (from {lo}): start at first_key's tile"
        pytest.fail(f"{case} visits key tiles {visited}, should visit {needed} — {hint}", pytrace=False)
