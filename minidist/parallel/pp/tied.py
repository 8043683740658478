"""Tied embeddings across pipeline stages (chapter 09).

A tied model uses one matrix E twice: as the token embedding (row lookup) and as the LM head (logits = h Eᵀ) (Press
& Wolf 2017, "Using the Output Embedding to Improve Language Models"; GPT-2). Its gradient is the sum of the two
uses' gradients, ∇E = ∇E_embed + ∇E_head. Pipeline parallelism puts the embedding on the first stage and the head on
the last, so each of those stages holds a copy of E, and each computes one of the two terms. Megatron-LM does the
same (Shoeybi et al. 2019, "Megatron-LM"; its "embedding group" of first and last stage): the copies start equal
and their gradients are all-reduced (summed) between the two stages before the optimizer step, so both see ∇E and,
with the same optimizer state, take the same update: the copies stay equal, bit for bit.

Here:

- both copies hold the one-process initial value: the last stage keeps E under its one-process name
  (`tok_emb.weight`, `pipeline.StageModule`), and the value is a function of (seed, name);
- the sum runs over the "tied" group of the topology (first and last stage of one pipeline: the same dp, cp and tp
  coordinates), after the data-parallel reduction and before clipping (`TiedGrads.sum_`); the reductions are sums,
  so their order does not change the result;
- under ZeRO the two stages must own the same elements of E over dp_cp: E gets a bucket of its own (stages 1-2) or a
  gather unit of its own (stage 3), the same flat layout on both stages, so each rank's slices line up with its
  partner's;
- the gradient norm counts E once: its placement says "2 copies over the tied group", a group inside pp
  (`layout.WITHIN`), and the norm sums over pp; the replica check compares the two copies over "tied".
"""

from __future__ import annotations

import dataclasses

from torch import nn

from minidist.comm.communicator import Comm
from minidist.comm.topology import Topology
from minidist.parallel.placement import GradPiece, Split, placement_of

TIED = "tied"


def is_tied(param: nn.Parameter) -> bool:
    """Whether another pipeline stage holds a copy of this parameter (a tied embedding on the first or last stage)."""
    return TIED in placement_of(param).splits


class TiedGrads:
    """Sums the gradient of the tied weight over its two copies (the first and the last stage of a pipeline)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def sum_(self, pieces: list[GradPiece]) -> None:
        """All-reduce, in place, this rank's pieces of tied weights (whole gradients, or the same ZeRO slices on both
        stages). Both partners hold the same pieces in the same order: their collectives match."""
        for grad, placement in pieces:
            if TIED in placement.splits:
                self.comm.all_reduce(grad)


def tie_across_stages(stage: nn.Module, topo: Topology) -> TiedGrads | None:
    """Record the copy of a tied embedding that this pipeline stage holds (a whole-tensor split over "tied" with 2
    replicas) and return what sums its gradient; None when this rank holds no copy to keep equal (no tie, pp = 1,
    a middle stage)."""
    embedding = getattr(stage, "tok_emb", None)
    if not stage.cfg.tie_embeddings or topo.size(TIED) < 2 or embedding is None:
        return None
    if getattr(stage, "v_shape", False):  # zbv: rank 0 holds the first and the last chunk, so E once, both uses
        return None
    param = embedding.weight
    param.placement = dataclasses.replace(placement_of(param),
                                          splits={**placement_of(param).splits, TIED: Split(None, 0, 1, 2)})
    return TiedGrads(topo.comm(TIED))
