"""Tensor and sequence parallelism (chapter 08): parity with the single-device run, vocab-parallel cross-entropy
against F.cross_entropy, the ledger against the communication formulas, and one-line errors for bad layouts.

One launch per world size runs every layout of that size and returns the results; the comparisons happen here.
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

from minidist.comm.communicator import Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model
from minidist.model.init import init_value
from minidist.parallel.dp.zero import ZeroOptimizer
from minidist.parallel.placement import clip_grad_norm_, full_tensor, gather_full, placement_of
from minidist.parallel.tp.tensor import apply_tensor_parallel, tensor_parallel_plan, validate_tensor_parallel
from minidist.parallel.tp.traffic import expected_tp_traffic
from minidist.parallel.tp.vocab import vocab_parallel_cross_entropy

# GPT-2's choices (GELU, LayerNorm with biases, learned positions, tied embeddings) on the parity shapes; with
# n_kv_heads=2, tp=4 replicates the kv heads, so this covers every special gradient path.
GPT_CFG = CFG.replace(mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True)
# Multi-head latent attention with query compression: heads split, the latent path replicated (chapter 05).
MLA_CFG = CFG.replace(attention="mla", mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                                qk_rope_head_dim=8, v_head_dim=16))
STEPS = 3

# (label, config name, dp, tp, sequence_parallel, steps); dp > 1 runs ZeRO stage 1 over dp_cp
LAYOUTS = {
    2: [("tp2", "llama", 1, 2, False, STEPS), ("tp2+sp", "llama", 1, 2, True, STEPS),
        ("gpt tp2+sp", "gpt", 1, 2, True, 2), ("mla tp2+sp", "mla", 1, 2, True, 2)],
    4: [("tp4", "llama", 1, 4, False, STEPS), ("tp4+sp", "llama", 1, 4, True, STEPS),
        ("dp2xtp2 zero1", "llama", 2, 2, False, STEPS), ("gpt tp4+sp", "gpt", 1, 4, True, 2)],
}
CONFIGS = {"llama": CFG, "gpt": GPT_CFG, "mla": MLA_CFG}


# ---------------------------------------------------------------------------------------------------------------
# What the ranks run
# ---------------------------------------------------------------------------------------------------------------


def _train(label: str, cfg_name: str, dp: int, tp: int, sequence_parallel: bool, steps: int) -> dict:
    cfg = CONFIGS[cfg_name]
    topo = Topology(ParallelDims(dp=dp, tp=tp), dist.get_rank(), dist.get_world_size())
    ledger = Ledger()
    tp_comm = topo.comm("tp", ledger)
    quiet = topo.comm("tp", Ledger())  # gathers for checking, kept out of the measured ledger
    dp_comm = topo.comm("dp_cp", Ledger())
    model = apply_tensor_parallel(build_model(cfg, seed=SEED), cfg, tp_comm, sequence_parallel)
    init_matches = all(torch.equal(full, init_value(name, full.shape, cfg, SEED))
                       for name, full in gather_full(model, quiet).items())
    optimizer = make_optimizer(model.parameters())
    zero = ZeroOptimizer(model, optimizer, dp_comm, stage=1) if dp > 1 else None
    splits = {name: placement_of(param).splits["tp"] for name, param in model.named_parameters()}
    losses, norms, grads, traffic = [], [], {}, {}
    rows = GLOBAL_BATCH // dp
    first = topo.coord("dp") * rows
    for step in range(steps):
        inputs, targets = global_batch(step)
        inputs, targets = inputs[first:first + rows], targets[first:first + rows]
        loss = vocab_parallel_cross_entropy(model(inputs), targets, tp_comm)
        loss.backward()
        if step == 0:
            traffic = ledger.totals()
        if zero is None:
            if step == 0:
                grads = gather_full(model, quiet, grads=True)
            pieces = [(p.grad, placement_of(p)) for p in model.parameters() if p.grad is not None]
            norms.append(float(clip_grad_norm_(pieces, GRAD_CLIP, {"tp": quiet})))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:  # ZeRO-1 over dp_cp: this tp shard's gradients averaged over dp, optimizer state sharded over dp
            if step == 0:
                grads = {n: full_tensor(g, splits[n], quiet) for n, g in zero.full_gradients().items()}
            norms.append(zero.clip_grad_norm(GRAD_CLIP, {"tp": quiet}))
            zero.step()
            zero.zero_grad()
        mean_loss = loss.detach().clone()
        dp_comm.all_reduce(mean_loss, op="avg")
        losses.append(mean_loss.item())
    keep_grads = topo.rank in (0, topo.world_size - 1)  # enough to check both ends of the grid; less to send back
    return {"label": label, "losses": losses, "norms": norms, "grads": grads if keep_grads else None,
            "traffic": traffic, "init_matches": init_matches, "tp_rank": tp_comm.rank, "batch": rows}


def _cross_entropy_case() -> dict:
    world = dist.get_world_size()
    comm = Topology(ParallelDims(tp=world), dist.get_rank(), world).comm("tp")
    torch.manual_seed(0)  # the same full logits on every rank
    logits = torch.randn(5, 7, 256) * 3
    targets = torch.randint(0, 256, (5, 7))
    targets[0, :3] = -100
    targets[2, 4] = -100
    local = logits.chunk(world, dim=-1)[comm.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm)
    loss.backward()
    per_token = vocab_parallel_cross_entropy(local.detach(), targets, comm, reduction="none")
    all_ignored = vocab_parallel_cross_entropy(local.detach(), torch.full_like(targets, -100), comm)
    return {"logits": logits, "targets": targets, "loss": loss.detach(), "grad": local.grad,
            "per_token": per_token, "all_ignored": all_ignored}


def _bf16_reduction_case() -> dict:
    """One forward+backward under bf16 autocast, partial sums reduced in bf16 and then in fp32."""
    comm_ledgers = {}
    for name, reduce_dtype in (("bf16", None), ("fp32", torch.float32)):
        topo = Topology(ParallelDims(tp=2), dist.get_rank(), 2)
        ledger = Ledger()
        comm = topo.comm("tp", ledger)
        model = apply_tensor_parallel(build_model(CFG, seed=SEED), CFG, comm, reduce_dtype=reduce_dtype)
        inputs, targets = global_batch(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        vocab_parallel_cross_entropy(logits, targets, comm).backward()
        comm_ledgers[name] = ledger.totals()
    return comm_ledgers


def world_cases(world_size: int) -> dict:
    out = {"train": [_train(*layout) for layout in LAYOUTS[world_size]], "ce": _cross_entropy_case()}
    if world_size == 2:
        out["bf16"] = _bf16_reduction_case()
    return out


@functools.lru_cache(maxsize=4)
def reference_for(cfg_name: str, steps: int) -> dict:
    if cfg_name == "llama" and steps == STEPS:
        return reference_run()
    # parity.reference_run's cache cannot hash a ModelConfig; its uncached body is the same harness
    return reference_run.__wrapped__(CONFIGS[cfg_name], steps)


@functools.lru_cache(maxsize=2)
def results(world_size: int) -> list[dict]:
    return run_ranks(world_cases, world_size, world_size, timeout=180)


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------

ALL_LAYOUTS = [(w, i) for w in LAYOUTS for i in range(len(LAYOUTS[w]))]


@pytest.mark.parametrize("world_size,index", ALL_LAYOUTS, ids=[LAYOUTS[w][i][0] for w, i in ALL_LAYOUTS])
def test_parity_with_single_device(world_size: int, index: int) -> None:
    label, cfg_name, _, _, _, steps = LAYOUTS[world_size][index]
    reference = reference_for(cfg_name, steps)
    for rank_out in results(world_size):
        run = rank_out["train"][index]
        assert run["init_matches"], f"{label}: shards are not slices of the full init values"
        assert_losses_match(run["losses"], reference["losses"], label)
        assert_norms_match(run["norms"], reference["grad_norms"], f"{label}: global grad norm")
        if run["grads"] is not None:
            assert_grads_match(run["grads"], reference["grads"], label)


@pytest.mark.parametrize("world_size,index", ALL_LAYOUTS, ids=[LAYOUTS[w][i][0] for w, i in ALL_LAYOUTS])
def test_ledger_equals_the_formulas(world_size: int, index: int) -> None:
    label, cfg_name, _, tp, sp, _ = LAYOUTS[world_size][index]
    for rank_out in results(world_size):
        run = rank_out["train"][index]
        want = expected_tp_traffic(CONFIGS[cfg_name], run["batch"], SEQ_LEN, tp, sp, rank=run["tp_rank"])
        assert run["traffic"] == want, f"{label}: ledger {run['traffic']} != formula {want}"


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_vocab_parallel_cross_entropy_equals_torch(world_size: int) -> None:
    for rank, rank_out in enumerate(results(world_size)):
        case = rank_out["ce"]
        logits = case["logits"].clone().requires_grad_()
        want = F.cross_entropy(logits.flatten(0, 1), case["targets"].flatten(), ignore_index=-100)
        want.backward()
        torch.testing.assert_close(case["loss"], want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(case["grad"], logits.grad.chunk(world_size, dim=-1)[rank], rtol=1e-5, atol=1e-7)
        per_token = F.cross_entropy(case["logits"].flatten(0, 1), case["targets"].flatten(), reduction="none")
        torch.testing.assert_close(case["per_token"].flatten(), per_token, rtol=1e-6, atol=1e-6)
        assert torch.isnan(case["all_ignored"]), "a mean over no counted targets is NaN, as in F.cross_entropy"


def test_fp32_reduction_of_bf16_partial_sums_doubles_the_bytes() -> None:
    batch = GLOBAL_BATCH
    for rank, rank_out in enumerate(results(2)):
        ledgers = rank_out["bf16"]
        assert ledgers["bf16"] == expected_tp_traffic(CFG, batch, SEQ_LEN, 2, compute_bytes=2, rank=rank)
        assert ledgers["fp32"] == expected_tp_traffic(CFG, batch, SEQ_LEN, 2, compute_bytes=2, reduce_bytes=4,
                                                      rank=rank)
        # the only difference: the 2 per block row-parallel sums, sent at twice the bytes
        extra = ledgers["fp32"][("all_reduce", "tp")]["bytes"] - ledgers["bf16"][("all_reduce", "tp")]["bytes"]
        assert extra == 2 * CFG.n_layers * batch * SEQ_LEN * CFG.d_model * 2


# ---------------------------------------------------------------------------------------------------------------
# No launch needed
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,tp,seq,sp,match", [
    ({}, 3, None, False, r"tp=3 does not divide n_heads=4"),
    (dict(n_heads=8, n_kv_heads=4, d_model=64), 8, None, False, None),  # 8 = 2 x 4 kv heads: replicated, fine
    (dict(n_heads=6, n_kv_heads=2, d_model=96, d_ff=192), 3, None, False, r"neither divides n_kv_heads=2"),
    (dict(d_ff=130), 4, None, False, r"tp=4 does not divide d_ff=130"),
    (dict(vocab_size=258), 4, None, False, r"tp=4 does not divide vocab_size=258 .*pad vocab_size to 260"),
    ({}, 2, 33, True, r"sequence parallel needs seq_len=33 divisible by tp=2"),
    ({}, 2, 33, False, None),
    (dict(attention="mla"), 2, None, False, None),  # MLA: split by heads
    (dict(moe=dict(n_experts=4, top_k=2)), 2, None, False, None),  # MoE: whole on every tp rank (chapter 11)
    ({}, 0, None, False, r"tp must be a positive integer"),
])
def test_bad_layouts_give_one_line_errors(change, tp, seq, sp, match) -> None:
    cfg = CFG.replace(**change)
    if match is None:
        validate_tensor_parallel(cfg, tp, seq, sp)
        return
    with pytest.raises(ValueError, match=match) as info:
        validate_tensor_parallel(cfg, tp, seq, sp)
    assert "\n" not in str(info.value)


def test_plan_names_every_linear_and_keeps_norms_replicated_without_sp() -> None:
    model = build_model(CFG, seed=SEED)
    plan = tensor_parallel_plan(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(plan), f"linears without a plan: {sorted(linears - set(plan))}"
    assert not any(style.startswith("sequence") for style in plan.values())
    sp_plan = tensor_parallel_plan(model, sequence_parallel=True)
    norms = {n for n in dict(model.named_modules()) if n.endswith("norm")}
    assert {n for n, s in sp_plan.items() if s == "sequence_norm"} == norms
