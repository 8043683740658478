"""Context parallelism (chapter 10) through `parallelize`: parity with one process for every variant and its
compositions, the ledger against the byte formulas, the causal mask's work per rank, the blockwise kernel against
full attention in fp64, and one-line errors for layouts that cannot work.

One launch per world size runs every layout of that size; the comparisons happen here.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity import (
    CFG,
    GLOBAL_BATCH,
    GRAD_CLIP,
    SEED,
    SEQ_LEN,
    assert_grads_match,
    assert_losses_match,
    assert_norms_match,
    global_batch,
    make_optimizer,
    reference_run,
)

from minidist.comm.communicator import Comm, Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model, get_preset, lm_loss
from minidist.model.moe.stats import update_router_biases
from minidist.parallel import ParallelOptions, parallelize
from minidist.parallel.cp import (
    Work,
    allgather_attention,
    attend_block,
    attend_block_backward,
    blockwise_attention,
    expected_cp_traffic,
    merge,
    ring_attention,
    score_balance,
    shard_sequence,
    unmasked_scores,
    validate_context_parallel,
)
from minidist.parallel.placement import full_tensor, placement_of
from minidist.train.blocks import apply_recompute

GPT_CFG = CFG.replace(mlp="gelu", norm="layernorm", bias=True, position="learned")  # positions through pos_emb
MLA_CFG = CFG.replace(attention="mla", mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                                qk_rope_head_dim=8, v_head_dim=16))
# Dropless MoE with the sequence-wise balance loss (its routing counts summed over each sequence's cp ranks), the
# z-loss, and auxiliary-loss-free router biases (the expert loads of each cp rank's tokens summed over dp_cp).
MOE_CFG = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                     moe=dict(n_experts=4, top_k=2, router="sigmoid", bias_update_speed=0.05, aux_loss_coef=0.05,
                              z_loss_coef=0.01))
CONFIGS = {"llama": CFG, "gpt": GPT_CFG, "mla": MLA_CFG, "moe": MOE_CFG}

# label: (config, dims, options, steps)
LAYOUTS = {
    2: {
        "cp2 ring": ("llama", dict(cp=2), dict(cp_impl="ring"), 3),
        "cp2 allgather": ("llama", dict(cp=2), dict(cp_impl="allgather"), 3),
        "cp2 ulysses": ("llama", dict(cp=2), dict(cp_impl="ulysses"), 3),
        "cp2 zero3 ring": ("llama", dict(cp=2), dict(cp_impl="ring", zero=3), 2),
        "cp2 moe ring": ("moe", dict(cp=2), dict(cp_impl="ring"), 3),
        "cp2 mla ring": ("mla", dict(cp=2), dict(cp_impl="ring"), 2),
        "cp2 mla ulysses": ("mla", dict(cp=2), dict(cp_impl="ulysses"), 2),
        "cp2 gpt allgather 2mb": ("gpt", dict(cp=2), dict(cp_impl="allgather", microbatches=2), 2),
        # full recomputation: each block's forward, its attention's traffic with it, runs again in the backward
        "cp2 ring recompute": ("llama", dict(cp=2), dict(cp_impl="ring", recompute="full"), 2),
        "cp2 allgather recompute": ("llama", dict(cp=2), dict(cp_impl="allgather", recompute="full"), 2),
        "cp2 ulysses recompute": ("llama", dict(cp=2), dict(cp_impl="ulysses", recompute="full"), 2),
        "cp2 moe ring recompute": ("moe", dict(cp=2), dict(cp_impl="ring", recompute="full"), 2),
    },
    4: {
        "cp4 ring": ("llama", dict(cp=4), dict(cp_impl="ring"), 3),
        "cp4 allgather": ("llama", dict(cp=4), dict(cp_impl="allgather"), 3),
        "cp4 ulysses": ("llama", dict(cp=4), dict(cp_impl="ulysses"), 3),  # 2 kv heads replicated onto 4 ranks
        "cp2 dp2 ring": ("llama", dict(cp=2, dp=2), dict(cp_impl="ring"), 3),
        "cp2 tp2 ring": ("llama", dict(cp=2, tp=2), dict(cp_impl="ring"), 2),
        "cp2 tp2 sp allgather": ("llama", dict(cp=2, tp=2), dict(cp_impl="allgather", sequence_parallel=True), 2),
        "cp2 tp2 sp ulysses": ("llama", dict(cp=2, tp=2), dict(cp_impl="ulysses", sequence_parallel=True), 2),
        "cp2 pp2 ring": ("llama", dict(cp=2, pp=2), dict(cp_impl="ring", microbatches=2), 2),
    },
}


# ---------------------------------------------------------------------------------------------------------------
# What the ranks run
# ---------------------------------------------------------------------------------------------------------------


def _full_grads(parallel, topo: Topology) -> dict[str, torch.Tensor]:
    """The averaged gradient of every parameter this rank's stage holds, whole (tp shards gathered), by name."""
    grads = parallel.full_gradients()
    if topo.size("tp") > 1:
        quiet = topo.comm("tp", Ledger())
        params = dict(parallel.model.named_parameters())
        grads = {n: full_tensor(g, placement_of(params[n]).splits["tp"], quiet) for n, g in grads.items()}
    return grads


def _train(label: str, cfg_name: str, dims: dict, options: dict, steps: int) -> dict:
    cfg = CONFIGS[cfg_name]
    topo = Topology(ParallelDims(**dims), dist.get_rank(), dist.get_world_size())
    options = dict(options)
    model = build_model(cfg, seed=SEED)
    if options.get("recompute", "none") != "none":
        apply_recompute(model, options.pop("recompute"))  # as the trainer does, before parallelize
    parallel = parallelize(model, cfg, topo, ParallelOptions(**options),
                           lambda model: make_optimizer(model.parameters()))
    microbatches = options.get("microbatches", 1)
    rows = GLOBAL_BATCH // topo.size("dp")
    first = topo.coord("dp") * rows
    losses, norms, grads, traffic = [], [], None, {}
    for step in range(steps):
        inputs, targets = global_batch(step)
        inputs, targets = inputs[first:first + rows], targets[first:first + rows]
        losses.append(parallel.forward_backward(list(zip(inputs.chunk(microbatches), targets.chunk(microbatches))))
                      .loss)
        if step == 0:
            traffic = parallel.context.comm.ledger.totals()
            keep = topo.coord("dp") == 0 and topo.coord("tp") == 0
            grads = _full_grads(parallel, topo) if keep else None
            if not keep and topo.size("tp") > 1:
                _full_grads(parallel, topo)  # the tp gathers are collective
        norms.append(float(parallel.clip_grad_norm_(GRAD_CLIP)))
        parallel.step()
    layers = [i for i, block in enumerate(parallel.model.blocks) if block is not None]  # this pipeline stage's
    return {"losses": losses, "norms": norms, "grads": grads, "traffic": traffic, "batch": rows // microbatches,
            "layers": layers,
            "microbatches": microbatches, "tp_rank": topo.coord("tp"), "cp_rank": topo.coord("cp")}


def _work_per_rank() -> dict:
    """Unmasked scores each rank's ring (both layouts) and all-gather kernels computed, on one attention call."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 64, 8), torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8)
    out = {}
    for name, fn, layout in (("ring contiguous", ring_attention, "contiguous"), ("ring zigzag", ring_attention,
                             "zigzag"), ("allgather zigzag", allgather_attention, "zigzag")):
        work = Work()
        fn(*(shard_sequence(t, rank, cp, layout, dim=2) for t in (q, k, v)), Comm(None, Ledger()), layout,
           work=work)
        out[name] = work.scores
    return out


def _bf16_ledgers() -> dict:
    """One forward + backward per variant under bf16 autocast: q, k, v cross the wire in bf16, the ring's gradient
    accumulators in fp32."""
    topo = Topology(ParallelDims(cp=dist.get_world_size()), dist.get_rank(), dist.get_world_size())
    inputs, targets = global_batch(0)
    out = {}
    for impl in ("ring", "allgather", "ulysses"):
        parallel = parallelize(build_model(CFG, seed=SEED), CFG, topo, ParallelOptions(cp_impl=impl),
                               lambda model: make_optimizer(model.parameters()))
        parallel.forward_backward([(inputs, targets)], functools.partial(torch.autocast, "cpu", torch.bfloat16))
        out[impl] = parallel.context.comm.ledger.totals()
    return out


def world_cases(world_size: int) -> dict:
    out = {label: _train(label, *layout) for label, layout in LAYOUTS[world_size].items()}
    out["work"] = _work_per_rank()
    if world_size == 2:
        out["bf16"] = _bf16_ledgers()
    return out


@functools.lru_cache(maxsize=2)
def results(world_size: int) -> list[dict]:
    return run_ranks(world_cases, world_size, world_size, timeout=600)


@functools.lru_cache(maxsize=8)
def reference_for(cfg_name: str, steps: int) -> dict:
    if cfg_name == "moe":
        return _moe_reference(steps)
    return reference_run.__wrapped__(CONFIGS[cfg_name], steps)


def _moe_reference(steps: int) -> dict:
    """parity.reference_run with the balancing losses in the objective and the router-bias update after every
    step (what ParallelModel does)."""
    model = build_model(MOE_CFG, seed=SEED)
    optimizer = make_optimizer(model.parameters())
    losses, grad_norms, first_grads = [], [], {}
    for step in range(steps):
        inputs, targets = global_batch(step)
        loss = lm_loss(model(inputs), targets)
        (loss + model.aux_loss()).backward()
        if step == 0:
            first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_router_biases(model)
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": grad_norms, "grads": first_grads}


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------

ALL = [(w, label) for w in LAYOUTS for label in LAYOUTS[w]]


@pytest.mark.parametrize("world_size,label", ALL, ids=[label for _, label in ALL])
def test_parity_with_one_process(world_size: int, label: str, one_thread) -> None:
    """Every step's global loss and gradient norm, and the first step's full gradients, equal one process's."""
    cfg_name, _, _, steps = LAYOUTS[world_size][label]
    reference = reference_for(cfg_name, steps)
    held = set()
    for rank_out in results(world_size):
        run = rank_out[label]
        assert_losses_match(run["losses"], reference["losses"], label)
        assert_norms_match(run["norms"], reference["grad_norms"], f"{label}: global grad norm")
        if run["grads"] is not None:
            assert_grads_match(run["grads"], {n: reference["grads"][n] for n in run["grads"]}, label)
            held |= set(run["grads"])
    assert held == set(reference["grads"]), f"{label}: no rank returned {sorted(set(reference['grads']) - held)}"


@pytest.mark.parametrize("world_size,label", ALL, ids=[label for _, label in ALL])
def test_ledger_equals_the_formula(world_size: int, label: str) -> None:
    """The bytes and calls each cp rank sent in the first step are exactly `expected_cp_traffic`."""
    cfg_name, dims, options, _ = LAYOUTS[world_size][label]
    cfg = CONFIGS[cfg_name]
    for rank_out in results(world_size):
        run = rank_out[label]
        want = expected_cp_traffic(cfg, options["cp_impl"], run["batch"], SEQ_LEN, dims["cp"], dims.get("tp", 1),
                                   layers=run["layers"], rank=run["cp_rank"],
                                   recomputed=options.get("recompute") == "full")
        want = {key: {k: v * run["microbatches"] for k, v in entry.items()} for key, entry in want.items()}
        assert run["traffic"] == want, f"{label}: ledger {run['traffic']} != formula {want}"


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
def test_bf16_ledger_equals_the_formula(impl: str) -> None:
    """Under bf16 autocast the formula's element size is 2 bytes; the ring's accumulators stay 4."""
    for rank, rank_out in enumerate(results(2)):
        want = expected_cp_traffic(CFG, impl, GLOBAL_BATCH, SEQ_LEN, 2, rank=rank, element_size=2)
        assert rank_out["bf16"][impl] == want, f"{impl} bf16: ledger {rank_out['bf16'][impl]} != formula {want}"
    fp32 = expected_cp_traffic(CFG, impl, GLOBAL_BATCH, SEQ_LEN, 2, element_size=4)
    bf16 = expected_cp_traffic(CFG, impl, GLOBAL_BATCH, SEQ_LEN, 2, element_size=2)
    ratio = sum(e["bytes"] for e in bf16.values()) / sum(e["bytes"] for e in fp32.values())
    # ring at cp 2: 2 block sends halve, the 2 accumulator hops (fp32) do not: (1 + 2) / (2 + 2)
    assert ratio == (3 / 4 if impl == "ring" else 1 / 2)


def test_causal_work_is_balanced_by_the_zigzag_layout() -> None:
    """Unmasked scores counted by the kernels: zig-zag ranks do equal work (max/min = 1); contiguous ranks do not
    (max/min = 1 + 2(cp−1)·c/(c+1), c = T/cp, which tends to 2·cp − 1); the counts are the formula's."""
    seq_len, cp = 64, 4
    per_rank = [r["work"] for r in results(cp)]
    for name, layout in (("ring contiguous", "contiguous"), ("ring zigzag", "zigzag"),
                         ("allgather zigzag", "zigzag")):
        counts = [w[name] for w in per_rank]
        assert counts == [unmasked_scores(seq_len, cp, r, layout) for r in range(cp)], name
        assert sum(counts) == seq_len * (seq_len + 1) // 2, name  # together: the causal triangle, once
    zigzag = [w["ring zigzag"] for w in per_rank]
    contiguous = [w["ring contiguous"] for w in per_rank]
    assert max(zigzag) == min(zigzag)
    c = seq_len // cp
    assert max(contiguous) / min(contiguous) == pytest.approx(1 + 2 * (cp - 1) * c / (c + 1), rel=1e-12)
    assert score_balance(1 << 16, cp, "contiguous") == pytest.approx(2 * cp - 1, rel=1e-3)
    assert score_balance(1 << 16, cp, "zigzag") == 1.0


# ---------------------------------------------------------------------------------------------------------------
# No launch needed
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v_dim", [5, 6], ids=["plain kernel (MLA-like head sizes)", "fused where it can"])
def test_blockwise_online_softmax_equals_full_attention_in_fp64(v_dim: int, one_thread) -> None:
    """Forward and backward of the blockwise kernel (GQA; blocks aligned, or not aligned with each other) equal full
    causal attention to fp64 rounding; merging two halves equals the whole. With equal head sizes the aligned
    blocks run torch's CPU flash kernel, the others the plain one."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 24, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 24, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 24, v_dim, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 4, 24, v_dim, dtype=torch.float64)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    want = torch.autograd.grad((full * grad).sum(), (q, k, v))
    for q_chunks, k_chunks in ((1, 1), (2, 2), (3, 4), (4, 6)):
        out = blockwise_attention(q, k, v, q_chunks=q_chunks, k_chunks=k_chunks)
        torch.testing.assert_close(out, full, rtol=0, atol=1e-13)
        for got, ref in zip(torch.autograd.grad((out * grad).sum(), (q, k, v)), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # the online softmax's merge of two disjoint key sets
        scale = 6 ** -0.5
        a, b = attend_block(q, k[:, :, :10], v[:, :, :10], scale), attend_block(q, k[:, :, 10:], v[:, :, 10:], scale)
        whole_out, whole_lse = attend_block(q, k, v, scale)
        out, lse = merge(a, b)
        torch.testing.assert_close(out, whole_out, rtol=0, atol=1e-14)
        torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-14)


def test_fused_and_plain_block_kernels_agree_in_fp64(one_thread) -> None:
    """torch's CPU flash kernel and the plain one: the same block output and log-sum-exp, and the same block
    gradients given another block's merged (final) output and log-sum-exp, for full and causal blocks."""
    torch.manual_seed(1)
    q, k, v, k2, v2 = (torch.randn(1, 4 if i == 0 else 2, 16, 8, dtype=torch.float64) for i in range(5))
    dout, scale = torch.randn(1, 4, 16, 8, dtype=torch.float64), 8 ** -0.5
    for seen in ("all", "causal"):
        fused, plain = (attend_block(q, k, v, scale, seen, fused=f) for f in (True, False))
        for got, ref in zip(fused, plain):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
        out, lse = merge(plain, attend_block(q, k2, v2, scale, "all", fused=False))  # final over both blocks
        grads = [attend_block_backward(dout, q, k, v, out, lse, scale, seen, fused=f) for f in (True, False)]
        for got, ref in zip(*grads):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)


@pytest.mark.parametrize("change,cp,impl,seq,tp,sp,match", [
    ({}, 2, "ring", 30, 1, False, r"seq_len=30 does not split into 2·cp chunks \(zig-zag\) = 4"),
    ({}, 4, "allgather", 36, 1, False, r"seq_len=36 does not split into 2·cp chunks \(zig-zag\) = 8"),
    ({}, 4, "ulysses", 36, 1, False, None),  # contiguous: cp = 4 chunks of 9
    ({}, 4, "ulysses", 34, 1, False, r"seq_len=34 does not split into cp chunks = 4"),
    ({}, 2, "ring", 36, 4, True, r"sequence parallel splits each cp rank.s 18 tokens over tp=4"),
    ({}, 2, "ring", 24, 4, True, None),  # 2·cp·tp = 16 does not divide 24, but each rank's 12 split over tp=4
    (dict(n_heads=6, n_kv_heads=2, d_model=96), 4, "ulysses", 32, 1, False, r"ulysses splits the 6 attention heads"),
    (dict(n_heads=12, n_kv_heads=3, d_model=96), 4, "ulysses", 32, 1, False, r"the 3 kv heads per tp rank"),
    (dict(n_heads=8, n_kv_heads=2, d_model=64), 4, "ulysses", 32, 1, False, None),  # kv replicated to 4
    (dict(n_heads=8, n_kv_heads=2, d_model=64), 4, "ulysses", 32, 2, False, None),  # 4 heads, 1 kv per tp rank
    ({}, 2, "magic", 32, 1, False, r"unknown context-parallel implementation 'magic'"),
    ({}, 0, "ring", 32, 1, False, r"cp must be a positive integer"),
    (dict(moe=dict(n_experts=4, capacity_factor=1.25)), 2, "ring", 32, 1, False, r"capacity ranks the slots of a "
     r"whole sequence by position"),
    (dict(moe=dict(n_experts=4)), 2, "ring", 32, 1, False, None),  # dropless: exact
])
def test_bad_layouts_give_one_line_errors(change, cp, impl, seq, tp, sp, match) -> None:
    cfg = CFG.replace(**change)
    if match is None:
        validate_context_parallel(cfg, cp, impl, seq, tp, sp)
        return
    with pytest.raises(ValueError, match=match) as info:
        validate_context_parallel(cfg, cp, impl, seq, tp, sp)
    assert "\n" not in str(info.value)


def test_block_kernel_by_device_dtype_and_mask() -> None:
    from minidist.parallel.cp.blockwise import block_kernel

    bf16, f32 = torch.bfloat16, torch.float32
    assert block_kernel("cuda", bf16, 128, 128, masked=False) == "flash_cuda"  # bf16 autocast on a GPU
    assert block_kernel("cuda", torch.float16, 64, 64, masked=False) == "flash_cuda"
    assert block_kernel("cuda", f32, 128, 128, masked=False) == "einsum"  # --dtype fp32: exact fp32, as before
    assert block_kernel("cuda", bf16, 320, 320, masked=False) == "einsum"  # beyond FlashAttention-2's head size
    assert block_kernel("cuda", bf16, 192, 128, masked=False) == "einsum"  # MLA's unequal q/k and v head sizes
    assert block_kernel("cuda", bf16, 128, 128, masked=True) == "einsum"  # a mask beyond the causal triangle
    assert block_kernel("cpu", f32, 64, 64, masked=False) == "flash_cpu"
    assert block_kernel("cpu", f32, 64, 64, masked=True) == "einsum"


def test_the_cuda_flash_block_keeps_shapes_and_sums_kv_head_gradients() -> None:
    # No GPU here: the meta device runs the kernels' shape functions, so the plumbing around them (repeated kv
    # heads, L's shape and dtype, dk/dv summed back onto the kv heads) is checked; the values need a GPU.
    from minidist.parallel.cp.blockwise import _flash_cuda, _flash_cuda_backward

    q = torch.empty(2, 8, 16, 64, dtype=torch.bfloat16, device="meta")
    k = v = torch.empty(2, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    out, lse = _flash_cuda(q, k, v, 0.125, causal=True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, torch.float32, (2, 8, 16), torch.float32)
    dq, dk, dv = _flash_cuda_backward(out, q, k, v, out, lse, 0.125, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {torch.float32}


def test_autocast_dtype_reaches_the_blocks_only_on_cuda() -> None:
    from minidist.parallel.cp.blockwise import in_autocast_dtype

    x = torch.zeros(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert in_autocast_dtype(x)[0].dtype == torch.float32  # a CPU computes as it always has


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_block_decisions_come_from_host_ranges_that_match_the_positions(layout):
    """Ring and all-gather CP decide which chunk pairs to compute from Python ranges, with no read of a device
    tensor: the ranges are the positions `shard_positions` gives, and each decision and its count of visible pairs
    agree with the mask built from those positions."""
    from minidist.parallel.cp.blockwise import visibility, visible_pairs
    from minidist.parallel.cp.sharding import chunks_per_rank, shard_positions, shard_spans

    seq_len, cp = 24, 3
    spans = {r: shard_spans(seq_len, r, cp, layout) for r in range(cp)}
    for r in range(cp):
        assert [p for span in spans[r] for p in span] == shard_positions(seq_len, r, cp, layout).tolist()
        assert len(spans[r]) == chunks_per_rank(layout)
    chunks = [span for r in range(cp) for span in spans[r]]
    for q in chunks:
        for k in chunks:
            full = torch.tensor(list(k))[None, :] <= torch.tensor(list(q))[:, None]
            seen = visibility(q, k, torch.device("cpu"))
            expected = {"all": full.all(), "none": not full.any(), "causal": q == k}
            if isinstance(seen, str):
                assert expected[seen], (q, k, seen)
            else:
                assert torch.equal(seen, full)
            assert visible_pairs(q, k) == int(full.sum())
    assert visibility(range(0, 4), range(2, 6), torch.device("cpu")).tolist()[0] == [False] * 4  # partial overlap
