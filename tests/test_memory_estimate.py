"""The memory model (minidist.plan.rank_memory) against bytes measured per rank by tensor accounting
(minidist.plan.memory_measure: storages of parameters, gradients and optimizer state; saved-tensor hooks for the
activations at their peak). Tolerance: `TOLERANCE` (5%) per part and rank; the model states come out exact."""

from __future__ import annotations

import pytest
import torch

from minidist import memory
from minidist.comm.launch import run_ranks
from minidist.flops import count_params
from minidist.memory import PeakSavedBytes
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel import Layout
from minidist.plan.memory_measure import measure_layouts
from minidist.plan.rank_memory import (
    BF16_MIXED,
    FP32,
    TOLERANCE,
    estimate_memory,
    layer_activation_bytes,
    model_state_bytes,
    rank_params,
)
from minidist.plan.stages import chunks_in_flight

CFG = get_preset("tiny", d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
MOE = CFG.replace(moe={"n_experts": 4, "top_k": 2, "n_shared_experts": 1, "d_expert": 64, "first_dense_layers": 1})
SEQ_LEN, GLOBAL_BATCH = 32, 8
PARTS = ("params", "grads", "optimizer", "activations")

# (label, model, layout) at world size 2: every dimension, ZeRO 1 and 3, sequence parallel, two schedules, the three
# CP attentions, recomputation, experts.
CASES = [
    ("dp2 zero1", CFG, Layout.of(dp=2, zero=1)),
    ("dp2 zero3 recompute", CFG, Layout.of(dp=2, zero=3, recompute="full")),
    ("tp2", CFG, Layout.of(tp=2)),
    ("tp2 sp", CFG, Layout.of(tp=2, sequence_parallel=True)),
    ("pp2 1f1b m4", CFG, Layout.of(pp=2, microbatches=4)),
    ("pp2 interleaved m4 v2", CFG, Layout.of(pp=2, microbatches=4, virtual_stages=2, schedule="interleaved")),
    ("cp2 ring", CFG, Layout.of(cp=2)),
    ("cp2 allgather", CFG, Layout.of(cp=2, cp_impl="allgather")),
    ("dp2 ep2 moe zero2", MOE, Layout.of(dp=2, ep=2, zero=2)),
]


def _measure(model_cfg, cases) -> list[list[dict]]:
    return run_ranks(measure_layouts, 2, model_cfg, {label: layout for label, _, layout in cases}, SEQ_LEN,
                     GLOBAL_BATCH, timeout=180, case="memory model layouts")


def test_memory_model_matches_measured_bytes_per_rank():
    measured = {}
    for model_cfg in (CFG, MOE):
        mine = [c for c in CASES if c[1] is model_cfg]
        for rank, results in enumerate(_measure(model_cfg, mine)):
            for case, got in zip(mine, results):
                measured[case[0], rank] = (case, got)
    assert len({label for label, _ in measured}) >= 4
    for (label, rank), ((_, model_cfg, layout), got) in measured.items():
        micro_batch = GLOBAL_BATCH // layout.dims.dp // layout.options.microbatches
        est = estimate_memory(model_cfg, layout, SEQ_LEN, micro_batch, FP32, stage=got["coords"]["pp"])
        for part in PARTS:
            want = got[part]
            assert want > 0, f"{label} rank {rank}: nothing measured for {part}"
            error = getattr(est, part) / want - 1
            assert abs(error) <= TOLERANCE, \
                f"{label} rank {rank}: {part} predicted {getattr(est, part):.0f} B, measured {want} B ({error:+.1%})"


def test_mla_block_activations_one_process():
    cfg = CFG.replace(attention="mla", mla={"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                            "qk_rope_head_dim": 8, "v_head_dim": 16})
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN))
    with PeakSavedBytes(params=list(model.parameters()), exclude=list(model.buffers())) as saved:
        lm_loss(model(tokens), tokens, reduction="sum").backward()
    est = estimate_memory(cfg, Layout(), SEQ_LEN, 2)
    assert abs(est.activations / saved.peak - 1) <= TOLERANCE, (est.activations, saved.peak)


def test_model_states_follow_zero_and_precision():
    n = count_params(CFG)
    whole = model_state_bytes(CFG, Layout(), BF16_MIXED)
    assert whole == {"params": 2 * n, "grads": 2 * n, "optimizer": 12 * n}  # ZeRO §3.1: 16 bytes per parameter
    assert sum(rank_params(CFG, Layout()).values()) == n
    stage3 = model_state_bytes(CFG, Layout.of(dp=4, zero=3), BF16_MIXED)
    assert stage3 == {k: v / 4 for k, v in whole.items()}
    # tp=2 splits every matrix, not the norms: between half and the whole
    half = sum(rank_params(CFG, Layout.of(tp=2)).values())
    assert n / 2 < half < n / 2 + 9 * CFG.d_model


@pytest.mark.parametrize("pp,m,expected", [(4, 8, 4), (4, 2, 2), (2, 4, 2)])
def test_1f1b_in_flight_is_p_minus_r(pp, m, expected):
    assert chunks_in_flight("1f1b", pp, m) == expected
    assert chunks_in_flight("afab", pp, m) == m
    assert chunks_in_flight("1f1b", pp, m, stage=pp - 1) == 1


def test_dense_block_is_chapter_01s_count():
    """The planner's dense GQA block equals chapter 01's tensor-by-tensor count (`activation_bytes_per_layer`)."""
    for dtype_bytes in (2, 4):
        mine = layer_activation_bytes(CFG, 0, SEQ_LEN * 2, Layout(), dtype_bytes)
        assert mine == memory.activation_bytes_per_layer(CFG, SEQ_LEN, 2, dtype_bytes)["total"]


@pytest.mark.parametrize("pp, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_interleaved_in_flight_is_megatrons_warm_up(pp, v):
    """`chunks_in_flight` of the interleaved schedule is Megatron's warm-up plus one, 2(p − r − 1) + (v − 1)g + 1
    (at most m·v; g the first group's micro-batches: p when p divides m, more when it does not), a formula: checked
    here on the built schedules, m a multiple of p or not."""
    from minidist.plan.stages import built_in_flight

    for m in sorted({pp, pp + 1, 2 * pp, 2 * pp + 1, 3 * pp - 1, 3 * pp, 5 * pp, 5 * pp + pp // 2, 7 * pp + 3}):
        for stage, peak in enumerate(built_in_flight("interleaved", pp, m, v)):
            assert peak == chunks_in_flight("interleaved", pp, m, v, stage)


def test_zero_bubble_in_flight_counts_come_from_their_schedules():
    """The zero-bubble schedules keep a micro-batch's activations until its W: the memory model counts that on the
    built schedule, not with the interleaved schedule's warm-up formula (which made zb1 look like 2p − 1 micro-batches
    on the first stage). ZB-H1 holds p micro-batches on every rank, as 1F1B's first stage does (Qi et al. 2023);
    ZB-V holds 2p chunk passes of half the layers; DualPipeV one more."""
    from minidist.plan.stages import chunks_in_flight

    p, m = 4, 8
    first_1f1b = chunks_in_flight("1f1b", p, m, 1, 0)
    assert [chunks_in_flight("zb1", p, m, 1, r) for r in range(p)] == [p] * p == [first_1f1b] * p
    assert [chunks_in_flight("zbv", p, m, 1, r) for r in range(p)] == [2 * p] * p
    assert [chunks_in_flight("dualpipev", p, m, 1, r) for r in range(p)] == [2 * p + 1] * p
