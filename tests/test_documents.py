"""Documents and their masks (issue 28, --doc-mask): ids, positions and the block-diagonal causal mask checked by
hand on tiny rows; the FLOPs the mask keeps; flex attention's mask against SDPA's; and the strongest check: a
packed row under the document mask gives the logits of each document run on its own (positions AND mask)."""

import warnings

import pytest
import torch

from minidist.model import build_model, get_preset
from minidist.model.documents import (
    Documents,
    attention_pairs,
    dense_attention_pairs,
    document_attention,
    document_ids,
    document_mask,
    document_mask_mod,
    document_positions,
    gathered_document_attention,
)

EOD = 9


def test_ids_and_positions_by_hand():
    tokens = torch.tensor([[1, 2, EOD, 3, EOD, EOD, 4, 5],
                           [EOD, 1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids(tokens, EOD)
    # The EOD token closes its document: the id increments AFTER it (an empty document is the EOD alone).
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert document_ids(torch.tensor([[1, 2, 3]]), EOD).tolist() == [[0, 0, 0]]  # no EOD: one document
    assert document_positions(torch.zeros(1, 4, dtype=torch.int32)).tolist() == [[0, 1, 2, 3]]


def test_mask_by_hand():
    ids = torch.tensor([[0, 0, 1, 1]])
    expected = [[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 0, 1, 0],  # the first token of document 1 sees only itself
                [0, 0, 1, 1]]
    assert document_mask(ids)[0, 0].int().tolist() == expected
    visible = document_mask_mod(ids)
    grid = torch.arange(4)
    assert visible(torch.zeros(4, 4, dtype=torch.long), 0, grid[:, None], grid[None, :]).int().tolist() == expected


def test_attention_pairs():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]])
    # documents of 3, 2, 1, 2 tokens in row 0 (6 + 3 + 1 + 3), of 1 and 7 in row 1 (1 + 28)
    assert int(attention_pairs(ids)) == 13 + 29 == int(document_mask(ids).sum())
    assert int(attention_pairs(torch.zeros(2, 8, dtype=torch.int32))) == dense_attention_pairs(2, 8) == 72


def test_flex_mask_mod_equals_sdpa():
    """The CUDA path's mask (flex attention, its BlockMask from the ids) against the CPU reference, eagerly on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (2, 256), generator=g)
    ids = document_ids(tokens, EOD)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = torch.randn(2, 2, 256, 16, generator=g), torch.randn(2, 2, 256, 16, generator=g)
    block_mask = create_block_mask(document_mask_mod(ids), 2, None, 256, 256, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is a reference implementation
        flex = document_attention(q, k, v, Documents(ids, block_mask))  # the CUDA branch, flex run eagerly
    torch.testing.assert_close(flex, document_attention(q, k, v, Documents(ids)), rtol=1e-5, atol=1e-5)
    assert block_mask.sparsity() > 0  # tiles no document spans are skipped


@pytest.mark.parametrize("overrides", [{}, {"attention": "mla"}, {"position": "learned"}],
                         ids=["gqa", "mla", "learned"])
def test_packed_row_equals_documents_alone(overrides):
    model = build_model(get_preset("tiny", **overrides), seed=3)
    tokens = torch.randint(0, 8, (2, 40), generator=torch.Generator().manual_seed(1))
    tokens[0, [6, 7, 25]] = EOD
    tokens[1, 17] = EOD
    ids = document_ids(tokens, EOD)
    with torch.no_grad():
        packed = model(tokens, document_positions(ids), docs=ids)
        for b in range(2):
            for doc in ids[b].unique():
                where = (ids[b] == doc).nonzero().flatten()
                alone = model(tokens[b:b + 1, where])
                torch.testing.assert_close(packed[b:b + 1, where], alone, rtol=1e-5, atol=1e-5)
        plain = model(tokens)
    assert (packed - plain).abs().max() > 1e-2  # the mask does something (documents after the first differ)
    torch.testing.assert_close(packed[:, :7], plain[:, :7])  # row 0's first document: nothing before it


def test_bad_document_ids_are_one_line_errors():
    model = build_model(get_preset("tiny"), seed=0)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="document ids for 1 rows, but the batch has 2"):
        model(tokens, docs=torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \[batch, seq\]"):
        model(tokens, docs=torch.zeros(2, 8, 1, dtype=torch.int32))


@pytest.mark.parametrize("rank", [0, 1])
def test_blockwise_context_parallel_kernel_keeps_documents_apart_in_fp64(rank):
    """The kernel of ring and all-gather attention with document ids: one zig-zag rank's query chunks against the
    keys of both ranks in shard order (what the all-gather hands over, and the ring's blocks one by one) equal the
    rows of full attention under the dense document mask, forward and backward, to fp64 rounding; and so does the
    all-gather's kernel on CUDA (flex over the gathered keys, forward). Causality comes from the chunks' global
    positions, the document condition from the whole sequence's ids."""
    from minidist.parallel.cp.blockwise import blockwise_attention
    from minidist.parallel.cp.sharding import shard_spans

    g = torch.Generator().manual_seed(rank)
    t, cp = 24, 2
    tokens = torch.ones(2, t, dtype=torch.long)
    tokens[0, [3, 10, 17]] = tokens[1, [7, 8, 20]] = EOD  # documents across the 4 chunks of 6 (an empty one too)
    ids = document_ids(tokens, EOD)
    q = torch.randn(2, 4, t, 6, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(2, 2, t, 6, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(2, 2, t, 6, dtype=torch.float64, generator=g).requires_grad_()
    q_spans = shard_spans(t, rank, cp, "zigzag")
    k_spans = [span for r in range(cp) for span in shard_spans(t, r, cp, "zigzag")]
    mine, keys = [i for s in q_spans for i in s], [i for s in k_spans for i in s]
    full = document_attention(q, k, v, Documents(ids))[:, :, mine]
    grad = torch.randn(full.shape, dtype=torch.float64, generator=g)
    want = torch.autograd.grad((full * grad).sum(), (q, k, v))
    out = blockwise_attention(q[:, :, mine], k[:, :, keys], v[:, :, keys], q_spans=q_spans, k_spans=k_spans,
                              docs=ids)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-13)
    for got, ref in zip(torch.autograd.grad((out * grad).sum(), (q, k, v)), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with torch.no_grad(), warnings.catch_warnings():  # all-gather's CUDA kernel: flex over the gathered keys
        warnings.simplefilter("ignore")  # (run eagerly here, forward only: flex has no backward on a CPU)
        def positions():
            return torch.tensor(mine), torch.tensor(keys)
        flex = gathered_document_attention(q[:, :, mine], k[:, :, keys], v[:, :, keys], ids, positions)
        docs = Documents.build(ids)  # the model's: one BlockMask per forward, shared by every block
        again = [gathered_document_attention(q[:, :, mine], k[:, :, keys], v[:, :, keys], docs, positions)
                 for _ in range(2)]
    torch.testing.assert_close(flex, full, rtol=0, atol=1e-12)
    for out in again:
        torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    assert docs.gathered is docs.gathered_mask(positions)  # built once
    assert docs.flex_mask() is None and docs.block_mask is None  # no whole-sequence mask off CUDA, none unasked


def test_the_model_prepares_each_cores_mask_before_the_blocks_run():
    """On CUDA a block may be compiled: the masks are built in the model's forward, before the blocks (each core's
    `prepare_documents`, once per core and forward), so a block only reads them. Off CUDA nothing is built."""
    from minidist.model.attention import CausalAttention

    events = []

    class Spy(CausalAttention):
        def prepare_documents(self, docs):
            events.append("prepare")
            super().prepare_documents(docs)

        def forward(self, q, k, v, scale=None, docs=None):
            events.append("attend")
            return super().forward(q, k, v, scale, docs)

    model = build_model(get_preset("tiny"), seed=0)
    for block in model.blocks:
        block.attn.core = Spy()
    tokens = torch.randint(0, 200, (2, 16))
    tokens[:, 5] = EOD
    model(tokens, docs=document_ids(tokens, EOD))
    n = len(model.blocks)
    assert n > 1 and events == ["prepare"] * n + ["attend"] * n
    events.clear()
    model(tokens, docs=document_ids(tokens, EOD), blocks=[1], embed=True)  # a pipeline stage's blocks only
    assert events == ["prepare", "attend"]
    docs = Documents.build(document_ids(tokens, EOD))
    CausalAttention().prepare_documents(docs)
    assert docs.block_mask is None  # a CPU tensor: SDPA's dense mask at attention time, no BlockMask


def test_a_built_documents_is_used_as_it_is(monkeypatch):
    """A pipeline builds one `Documents` per micro-batch and hands it to each of its chunks: the model uses it as
    it is (its cores get that object, no second build), so a GPU builds each micro-batch's BlockMask once."""
    from minidist.model.attention import CausalAttention

    seen = []

    class Spy(CausalAttention):
        def prepare_documents(self, docs):
            seen.append(docs)
            super().prepare_documents(docs)

    model = build_model(get_preset("tiny"), seed=0)
    for block in model.blocks:
        block.attn.core = Spy()
    tokens = torch.randint(0, 200, (2, 16))
    tokens[:, 5] = EOD
    ids = document_ids(tokens, EOD)
    documents = Documents.build(ids)
    builds = []
    monkeypatch.setattr(Documents, "build", classmethod(lambda cls, i: builds.append(i) or cls(i)))
    hidden = model(tokens, docs=documents, blocks=[0], head=False)  # chunk 0 of a pipeline
    logits = model(hidden, docs=documents, blocks=[1], embed=False)  # chunk 1, the same micro-batch
    assert builds == [] and len(seen) == 2 and all(d is documents for d in seen)
    torch.testing.assert_close(logits, model(tokens, docs=ids, blocks=[0, 1]), rtol=0, atol=0)
    assert len(builds) == 1  # ids alone: built here, once for the forward
    with pytest.raises(ValueError, match="document ids for 2 rows, but the batch has 1"):
        model(tokens[:1], docs=documents)
