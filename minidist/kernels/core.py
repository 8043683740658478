"""The attention core that runs the Triton kernel (`--attention-kernel triton`): what the trainer swaps in for the
model's own core (`CausalAttention`, SDPA), the way context parallelism swaps in its cores, so the model's code
stays plain PyTorch.

It takes what every core takes: q, k, v [B, H, T, d] after the projections and RoPE (k, v with fewer heads under
GQA; MLA's wider queries than values), the softmax scale, and with `--doc-mask` the forward's documents, of which
it reads the ids [B, T] (`docs.ids`): block-diagonal causal, the tiles between documents skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.kernels.flash import flash_attention


class TritonAttention(nn.Module):
    """Causal attention through `flash_attention`: no parameters, so parameter names and checkpoints are those of
    the SDPA core it replaces. Under `torch.compile` the kernel runs outside the traced graph (a graph break on
    each side): dynamo does not trace into the kernel's autograd function."""

    def __init__(self, blocks: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.blocks = blocks  # (BLOCK_M, BLOCK_N); None: the kernel's default for the head size

    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                docs: object | None = None) -> torch.Tensor:
        ids = getattr(docs, "ids", None)
        return flash_attention(q, k, v, causal=True, scale=scale, doc_ids=ids, blocks=self.blocks)

    def prepare_documents(self, docs: object) -> None:
        """Nothing to build before the blocks: the kernel reads the ids and finds each document's bounds itself."""
