"""Chapter 19 solutions: the three pieces of a FlashAttention-2 kernel, in plain torch on one tile at a time (what
one Triton program does, without Triton): the forward's tile loop, the backward of one key/value tile, and the
key range a causal (and document-masked) query tile must visit."""

import torch


def forward_tile_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_n: int,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
    total = torch.zeros(q.shape[0], dtype=q.dtype)
    acc = torch.zeros(q.shape[0], v.shape[1], dtype=q.dtype)
    for start in range(0, k.shape[0], block_n):
        s = q @ k[start:start + block_n].T * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, start:start + block_n], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[:, None])
        total = total * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v[start:start + block_n]
        m = m_new
    return acc / total[:, None], m + torch.log(total)


def kv_tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.exp(q @ k.T * scale - lse[:, None])
    delta = (dout * out).sum(dim=1)
    dv = p.T @ dout
    ds = p * (dout @ v.T - delta[:, None])
    return ds @ k * scale, ds.T @ q * scale, dv


def causal_kv_range(start_m: int, block_m: int, block_n: int, seq_len: int, first_key: int = 0) -> tuple[int, int]:
    hi = min((start_m + 1) * block_m, seq_len)
    return first_key // block_n * block_n, hi
