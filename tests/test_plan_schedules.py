"""The planner and chapter 15's schedules (minidist.plan.schedule_costs, rank_memory's V placement, step_time's
DualPipeV overlap), and the kernels and recipes the published runs used (Megatron's saved activations, FP8,
node-limited routing)."""

from __future__ import annotations

import dataclasses

import pytest

from minidist.hardware import Link, collective_time, link_of
from minidist.model import get_preset
from minidist.parallel import Layout
from minidist.parallel.pp.pipeline import chunk_layers
from minidist.parallel.pp.schedules import chunk_owners
from minidist.parallel.pp.zero_bubble import build_any_schedule
from minidist.plan import schedule_costs
from minidist.plan.cli import main
from minidist.plan.cluster import Cluster
from minidist.plan.rank_memory import (
    BF16_MEGATRON,
    BF16_MIXED,
    FP32,
    activation_bytes,
    estimate_memory,
    head_activation_bytes,
    layer_activation_bytes,
    rank_params,
)
from minidist.plan.search import search
from minidist.plan.stages import built_in_flight, chunks_in_flight, stage_kinds
from minidist.plan.step_time import Recipe, expert_all_to_all, predict_step


def _cluster(gpus_per_node: int = 8) -> Cluster:
    fast, slow = Link("fast", 4e11, 1e-6), Link("slow", 5e10, 5e-6)
    return Cluster("toy", 1e15, 80 * 2**30, gpus_per_node, fast, slow, 0.8, fp8_peak_flops=2e15)


def test_v_placement_puts_the_embedding_and_the_head_on_stage_0():
    """zbv / dualpipev: rank r holds chunks r and 2p−1−r (the schedule's own data says so), so rank 0 holds the
    embedding, the final norm, the head and the loss's activations; the last rank holds none of them."""
    cfg = get_preset("tiny")
    pp, m = 2, 4
    owners = chunk_owners(build_any_schedule("zbv", pp, m))
    chunks = chunk_layers(cfg.n_layers, pp, 2)
    for stage in range(pp):  # each rank's blocks are those of the chunks the built schedule runs there
        layers = [i for c, r in owners.items() if r == stage for i in chunks[c]]
        assert sum(stage_kinds(cfg, pp, 1, stage, "zbv")) == len(layers)
    vocab = cfg.vocab_size * cfg.d_model
    for schedule, head in (("1f1b", pp - 1), ("zbv", 0), ("dualpipev", 0)):
        lay = Layout.of(pp=pp, microbatches=m, schedule=schedule)
        params = [rank_params(cfg, lay, s)["dense"] for s in range(pp)]
        acts = [activation_bytes(cfg, lay, 64, 1, FP32, s)[0] for s in range(pp)]
        loss = head_activation_bytes(cfg, 64, lay, 4)
        if head == 0:  # the embedding and the head on the same rank; nothing of either on the last
            assert params[0] - params[1] >= 2 * vocab - cfg.d_model * 4 and acts[0] > loss > 0
        else:
            assert params[1] - params[0] < vocab  # the head on the last rank only
        assert stage_kinds(cfg, pp, 1, 0, schedule) == stage_kinds(cfg, pp, 1, 0, "1f1b") or head == 0


def test_v_rank_memory_follows_the_built_schedules_in_flight_counts():
    """Activations per stage = (chunk passes alive at the worst moment, counted on the built schedule) x one chunk's
    bytes; the counts stop growing past 2p micro-batches, so one build serves every m."""
    cfg = get_preset("tiny")
    pp, m = 2, 8
    for schedule in ("zb1", "zbv", "dualpipev"):
        built = list(built_in_flight(schedule, pp, m))
        assert [chunks_in_flight(schedule, pp, m, 1, s) for s in range(pp)] == built
        assert [chunks_in_flight(schedule, pp, 10**6, 1, s) for s in range(pp)] == built
        lay = Layout.of(pp=pp, microbatches=m, schedule=schedule)
        chunks = 2 if schedule != "zb1" else 1
        block = layer_activation_bytes(cfg, 0, 64, lay, 4)
        last = pp - 1
        blocks = sum(stage_kinds(cfg, pp, 1, last, schedule))
        head = head_activation_bytes(cfg, 64, lay, 4) if schedule == "zb1" else 0.0  # V: the head on rank 0
        want = built[last] * blocks * block / chunks + head
        assert activation_bytes(cfg, lay, 64, 1, FP32, last)[0] == pytest.approx(want)


def test_zero_bubble_bubbles_and_the_search_includes_them():
    """For one layout, zb1's predicted bubble is below 1F1B's and its step shorter; the V schedules' below zb1's;
    the search lists all three next to chapter 09's."""
    cfg = get_preset("tiny")
    seq, batch = 256, 64
    times = {}
    for schedule in ("1f1b", "zb1", "zbv", "dualpipev"):
        lay = Layout.of(dp=2, pp=4, microbatches=16, schedule=schedule)
        times[schedule] = predict_step(cfg, lay, seq, batch, _cluster(), FP32)
    assert times["zb1"].bubble < times["1f1b"].bubble and times["zb1"].total < times["1f1b"].total
    assert times["zbv"].bubble < times["zb1"].bubble and times["dualpipev"].bubble < times["zb1"].bubble
    plan = search(cfg, 8, seq, seq * batch, _cluster(), FP32)
    assert {"1f1b", "interleaved", "zb1", "zbv", "dualpipev"} <= {c.layout.options.schedule for c in plan.feasible}


def test_dualpipev_costs_come_from_its_schedule():
    """DualPipeV's excess over the work and its unpaired forwards do not grow with m (so the planner builds 2p);
    past `SIMULATED_UP_TO` ranks the excess is extended linearly, checked against a simulation at 24 ranks; its
    paired share is counted on the built schedule."""
    costs = schedule_costs.split_costs(0.2, "full")
    t = tuple(round(c / sum(costs), 2) for c in costs)
    for p in (2, 3, 5):
        excess = {schedule_costs._dualpipev_excess(p, m, *t) for m in (2 * p, 3 * p + 1)}
        assert max(excess) - min(excess) < 1e-9
        assert schedule_costs._unpaired_forwards(p, 2 * p) == schedule_costs._unpaired_forwards(p, 3 * p + 1)
    assert schedule_costs.dualpipev_excess(24, *t) == pytest.approx(schedule_costs._dualpipev_excess(24, 48, *t))
    assert schedule_costs.paired_share("zbv", 4, 16) == 0 < schedule_costs.paired_share("dualpipev", 4, 16)
    assert schedule_costs.paired_share("dualpipev", 4, 16) < schedule_costs.paired_share("dualpipev", 4, 64) < 1


def test_dualpipev_hides_the_expert_all_to_all_up_to_the_compute():
    """The same layout under ZB-V and DualPipeV: DualPipeV's overlapped pairs hide the EP all-to-all behind the
    other chunk's compute, at most the paired share of each (max(compute, comm) per pair, not their sum)."""
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2))
    lay = Layout.of(dp=8, ep=8, pp=2, microbatches=16, schedule="zbv")
    slow = _cluster(gpus_per_node=2)  # the ep group crosses nodes
    zbv = predict_step(cfg, lay, 256, 256, slow, BF16_MIXED)
    dual = predict_step(cfg, dataclasses.replace(lay, options=dataclasses.replace(lay.options, schedule="dualpipev")),
                        256, 256, slow, BF16_MIXED)
    share = schedule_costs.paired_share("dualpipev", 2, 16)
    hidden = min(share * (zbv.ep + zbv.pp), share * zbv.compute)
    assert zbv.ep > 0 and dual.ep + dual.pp == pytest.approx(zbv.ep + zbv.pp - hidden)
    assert dual.hidden == pytest.approx(zbv.hidden + hidden)


def test_megatron_kernels_split_every_saved_activation_over_tp():
    """Korthikanti et al. 2022, §4.2.2: with sequence parallelism and Megatron's kernels (inputs kept sharded,
    gathered again backward) a block's saved activations are those of tp = 1 divided by t; this trainer's SP
    linears keep the gathered input, so its count is not."""
    cfg = get_preset("tiny", n_kv_heads=4)  # as many key/value heads as tp ranks: none replicated
    n, p = 512, 2
    one = Layout.of()
    for tp in (2, 4):
        sp = Layout.of(tp=tp, sequence_parallel=True)
        megatron = layer_activation_bytes(cfg, 0, n, sp, p, fused=True, sp_regather=True)
        assert megatron * tp == pytest.approx(layer_activation_bytes(cfg, 0, n, one, p, fused=True, sp_regather=True))
        assert layer_activation_bytes(cfg, 0, n, sp, p) * tp > layer_activation_bytes(cfg, 0, n, one, p)
    # and the planner's memory for one layout: Megatron's kernels keep less
    lay = Layout.of(tp=4, sequence_parallel=True, pp=2, microbatches=4)
    assert estimate_memory(cfg, lay, 512, 1, BF16_MEGATRON).activations < \
        estimate_memory(cfg, lay, 512, 1, BF16_MIXED).activations


def test_fp8_and_node_limited_routing():
    """FP8 runs the blocks' linears at twice the rate (the rest at bf16's): compute between half and the whole;
    node-limited routing sends min(top_k, M) rows per token across the network instead of top_k."""
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2))
    lay = Layout.of(dp=8, ep=8)
    slow = _cluster(gpus_per_node=2)
    plain = predict_step(cfg, lay, 256, 64, slow, BF16_MIXED)
    fp8 = predict_step(cfg, lay, 256, 64, slow, BF16_MIXED, recipe=Recipe(fp8="tensorwise"))
    assert plain.compute / 2 < fp8.compute < plain.compute and fp8.ep < plain.ep  # FP8 dispatch: half the bytes
    limited = predict_step(cfg, lay, 256, 64, slow, BF16_MIXED, recipe=Recipe(max_nodes=1))
    assert cfg.moe.top_k > 1 and limited.ep < plain.ep


def test_node_limited_routing_overlaps_its_two_hops():
    """DeepSeek-V3 §3.2.2: a row crosses the network once per target node, to the GPU of the same index there (an
    all-to-all among the nodes: a token's own node, when among its M, costs no network hop), while the rows before
    it are forwarded over NVLink to their experts, so the all-to-all takes its slower hop (here the network's), not
    the two one after the other."""
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=4))
    lay, cluster, tokens, width = Layout.of(dp=8, ep=8), _cluster(gpus_per_node=2), 1024, 2
    rows = tokens * cfg.moe.top_k * cfg.d_model * width
    network = collective_time("all_to_all", rows * 2 / cfg.moe.top_k, 4, link_of(cluster, 8))  # 2 of the 4 nodes
    nvlink = collective_time("all_to_all", rows, 2, link_of(cluster, 2))
    assert nvlink < network
    assert expert_all_to_all(cfg, tokens, lay, cluster, width, max_nodes=2) == pytest.approx(network)


def test_recipe_flags_on_the_command_line(capsys):
    """--kernels, --fp8 and --max-nodes reach the search (the report says what it assumed); a bad value is one
    line."""
    from minidist.plan.cli import main

    args = ["--model", "tiny", "--gpus", "8", "--seq-len", "256", "--global-batch-tokens", "64K", "--top", "1"]
    assert main([*args, "--kernels", "megatron", "--fp8", "blockwise", "--max-nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM's kernels" in out and "FP8" in out and "at most 2 nodes" in out and "schedule" in out
    assert main([*args, "--max-nodes", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-nodes must be >= 0" in err


def test_fp8_blockwise_runs_at_deepgemms_measured_rates():
    """Blockwise FP8 on H800/H100: the dense linears at the FLOPs of DeepGEMM's measured GEMMs (a DeepSeek-V3 block,
    4,096 tokens) over their summed seconds, below twice the bf16 matmul rate; the routed experts by rows per expert
    (the table's rates at its rows, in between at rows between them, slower with fewer rows); the other recipes and
    other chips at their FP8 peak (twice bf16's) at the bf16 efficiency; a chip without FP8 refused. A layout's
    compute follows: EP 8 gives an expert 1,024 rows, EP 64 8,192."""
    from minidist.hardware import DEEPGEMM_DENSE, DEEPGEMM_EXPERTS, expert_gemm_rate, gemm_rate
    from minidist.plan.cluster import cluster_for_chip, fp8_rate

    assert gemm_rate(((1, 64, 64, 64, 500.0),)) == pytest.approx(500e12)
    two = ((1, 64, 64, 64, 500.0), (2, 32, 64, 64, 1000.0))  # equal FLOPs: the harmonic mean
    assert gemm_rate(two) == pytest.approx(2 / (1 / 500 + 1 / 1000) * 1e12)
    for rows, up, down in DEEPGEMM_EXPERTS:  # gate and up hold twice the down projection's FLOPs
        assert expert_gemm_rate(rows) == pytest.approx(3e12 / (2 / up + 1 / down))
    assert expert_gemm_rate(64) == expert_gemm_rate(256) < expert_gemm_rate(700) < expert_gemm_rate(1024)
    assert expert_gemm_rate(8192) == expert_gemm_rate(10**6)
    dense = [tflops * 1e12 for *_, tflops in DEEPGEMM_DENSE]
    for name in ("H800", "H100-SXM"):
        cluster = cluster_for_chip(name, efficiency=None)
        peak_rate = cluster.fp8_peak_flops * cluster.efficiency  # the FP8 peak (twice bf16's) at bf16's efficiency
        assert cluster.fp8_peak_flops == pytest.approx(2 * cluster.peak_flops, rel=1e-3)
        assert min(dense) < fp8_rate(cluster, "blockwise") < min(max(dense), peak_rate)
        assert fp8_rate(cluster, "blockwise", 1024) == expert_gemm_rate(1024)
        assert fp8_rate(cluster, "rowwise") == fp8_rate(cluster, "rowwise", 1024) == peak_rate
    h200 = cluster_for_chip("H200-SXM", efficiency=None)  # Hopper with FP8, not among DeepGEMM's measured chips
    assert fp8_rate(h200, "blockwise") == pytest.approx(h200.fp8_peak_flops * h200.efficiency)
    with pytest.raises(ValueError, match="A100 has no FP8 peak on record"):
        fp8_rate(cluster_for_chip("A100", efficiency=None), "rowwise")
    assert main(["--gpu", "A100", "--fp8", "rowwise"]) == 2  # refused in one line, before the search
    v3, h800 = get_preset("deepseek-v3"), cluster_for_chip("H800", efficiency=None)
    recipe = Recipe(fp8="blockwise")
    times = {ep: predict_step(v3, Layout.of(dp=128, pp=16, ep=ep, schedule="dualpipev", microbatches=120), 4096,
                              15360, h800, BF16_MEGATRON, recipe=recipe).compute for ep in (8, 64)}
    assert times[8] > times[64]  # the same FLOPs in smaller grouped GEMMs


def test_attention_kernels_run_at_their_measured_rate_by_key_length(capsys):
    """The attention kernels at FlashAttention-2's measured forward + backward rate, in its count of their work (3.5
    forwards, 4.5 when the forward is recomputed, where the model FLOPs count 3 and 4), for the keys each query meets:
    a ring step's 1/cp chunk (slower: fewer keys per query), the whole sequence under all-gather and Ulysses; with
    the causal mask's rate, but for context parallelism's whole blocks off the diagonal (all but 1/(2·cp) of the
    zigzag chunks' work, at the rate without a mask); the rest of the compute at the matmul rate, unchanged. A chip
    with no measured kernel keeps the matmul rate, and says so."""
    from minidist.hardware import ATTENTION_KERNEL, attention_rate, log2_interpolate
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.step_time import attention_seconds, compute_seconds, step_flops_per_rank

    table = ((512, 100.0), (2048, 300.0))
    assert log2_interpolate(table, 1024) == pytest.approx(200.0)  # halfway in log2(length)
    assert log2_interpolate(table, 64) == 100.0 and log2_interpolate(table, 10**6) == 300.0  # the ends held
    for kernel in ATTENTION_KERNEL.values():
        for rows in (kernel.causal, kernel.full):
            for length, tflops in rows:
                assert attention_rate(rows, length) == pytest.approx(tflops * 1e12)
            assert [t for _, t in rows] == sorted(t for _, t in rows)  # longer rows of keys, faster kernels
        assert all(attention_rate(kernel.full, n) > attention_rate(kernel.causal, n) for n, _ in kernel.causal)
    cfg, h100 = get_preset("llama3-8b"), cluster_for_chip("H100-SXM", efficiency=None)
    matmul = h100.peak_flops * h100.efficiency
    for recompute, forwards, kernel in (("none", 3, 3.5), ("full", 4, 4.5)):
        f = step_flops_per_rank(cfg, Layout.of(dp=8, recompute=recompute), 8192, 64)
        assert f.attention_kernel == pytest.approx(f.attention * kernel / forwards)
        fa2 = ATTENTION_KERNEL["H100-SXM"]
        expect = (f.total - f.attention) / matmul + f.attention_kernel / attention_rate(fa2.causal, 8192)
        assert compute_seconds(f, h100, attention_seconds(f, h100, 8192)) == pytest.approx(expect)
    bare = dataclasses.replace(h100, attention_kernel=None)
    assert compute_seconds(f, bare, attention_seconds(f, bare, 8192)) == pytest.approx(f.total / matmul)
    assert attention_seconds(f, bare, 8192) == pytest.approx(f.attention / matmul)
    times = {impl: predict_step(cfg, Layout.of(dp=2, cp=4, cp_impl=impl), 8192, 16, h100, BF16_MEGATRON)
             for impl in ("ring", "allgather", "ulysses")}
    f = step_flops_per_rank(cfg, Layout.of(dp=2, cp=4), 8192, 16)

    def per_flop(n, causal):  # seconds per FLOP of the kernels' work: `causal` of it under the mask, whole tiles else
        return causal / attention_rate(fa2.causal, n) + (1 - causal) / attention_rate(fa2.full, n)
    assert times["ring"].attention == pytest.approx(f.attention_kernel * per_flop(2048, 1 / 8))
    assert times["allgather"].attention == pytest.approx(f.attention_kernel * per_flop(8192, 1 / 8))
    assert times["ulysses"].attention == pytest.approx(f.attention_kernel * per_flop(8192, 1.0))
    assert times["ring"].compute - times["allgather"].compute == pytest.approx(
        f.attention_kernel * (per_flop(2048, 1 / 8) - per_flop(8192, 1 / 8)))
    assert main(["--model", "tiny", "--gpus", "8", "--seq-len", "256", "--top", "1"]) == 0
    assert "attention kernels at FlashAttention-2's forward + backward" in capsys.readouterr().out
    assert main(["--model", "tiny", "--gpus", "8", "--seq-len", "256", "--top", "1", "--gpu", "B200"]) == 0
    assert "attention kernels at the matmul rate (no attention kernel measured on B200)" in capsys.readouterr().out


def test_context_parallelism_by_implementation():
    """The traffic chapter 10's kernels send (their ledger's formula), by the α-β model. Ring: per block forward
    cp−1 sends each of this rank's K and V, per backward those again plus cp hops of their fp32 gradient
    accumulators, the forward's again when recomputed; overlapped with the attention kernels, only the excess
    exposed. All-gather (Llama 3's): per block forward an all-gather each of the whole sequence's K and V, per
    backward a reduce-scatter of each gradient, exposed; Ulysses: q, k, v and the output through an all-to-all
    each, forward and backward, exposed. The search tries the ring and the all-gather for cp > 1; an all-gather
    layout keeps more than its ring twin (the whole sequence's keys and values), so a ring layout over the budget
    spares the search its twin."""
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.search import CP_IMPLS, describe_layout
    from minidist.plan.step_time import context_parallel_time

    cfg, h100 = get_preset("llama3-8b"), cluster_for_chip("H100-SXM", efficiency=None)
    seq_len, tokens, p, layers, m = 8192, 2048, 2, 4, 3  # one sequence per micro-batch over cp 4
    k = tokens * (cfg.n_kv_heads // 2) * cfg.head_dim * p  # tp 2: this rank's K (and as many bytes of V)
    link = link_of(h100, 2 * 4)
    for recompute, again in (("none", 0), ("full", 1)):
        def of(impl, recompute=recompute, tp=2):
            return context_parallel_time(cfg, Layout.of(tp=tp, cp=4, cp_impl=impl, microbatches=m,
                                                        recompute=recompute), h100, 1, seq_len, p, (layers, 0), 1.0)
        gather = (1 + again) * 2 * collective_time("all_gather", 4 * k, 4, link)
        assert of("allgather") == (pytest.approx(m * layers * (gather + 2 * collective_time("reduce_scatter", 4 * k,
                                                                                            4, link))), 0.0)
        widths = [cfg.n_heads // 2 * cfg.head_dim, k / (tokens * p), k / (tokens * p),
                  cfg.n_heads // 2 * cfg.head_dim]  # 4 kv heads per tp rank: as many as cp ranks
        few = of("ulysses", tp=4)[0]
        copied = [cfg.n_heads // 4 * cfg.head_dim, 4 * cfg.head_dim, 4 * cfg.head_dim, cfg.n_heads // 4 * cfg.head_dim]
        link4 = link_of(h100, 16)  # 2 kv heads per tp rank, copied to the 4 ranks
        assert few == pytest.approx(m * layers * (2 + again) * sum(
            collective_time("all_to_all", tokens * w * p, 4, link4) for w in copied))
        per_pass = sum(collective_time("all_to_all", tokens * w * p, 4, link) for w in widths)
        assert of("ulysses") == (pytest.approx(m * layers * per_pass * (2 + again)), 0.0)
        blocks = (2 + again) * 3 * 2 * collective_time("send", k, 2, link)  # K and V, 3 hops, each forward + backward
        accumulators = 4 * 2 * collective_time("send", 2 * k, 2, link)  # dK and dV in fp32, 4 hops
        ring = m * layers * (blocks + accumulators)
        assert sum(of("ring")) == pytest.approx(ring) and of("ring")[0] == pytest.approx(max(0.0, ring - 1.0))
    v3 = get_preset("deepseek-v3")
    for model in (cfg, v3):  # GQA and MLA: the all-gather keeps the whole sequence's keys and values on top
        ring, gathered = (estimate_memory(model, Layout.of(cp=4, cp_impl=impl), 4096, 1, BF16_MEGATRON).activations
                          for impl in ("ring", "allgather"))
        assert gathered > ring
    plan = search(cfg, 16, 8192, 64 * 8192, h100)
    impls = {(c.layout.dims.cp > 1, c.layout.options.cp_impl) for c in plan.feasible + plan.rejected}
    assert impls == {(False, "ring")} | {(True, impl) for impl in CP_IMPLS}
    assert describe_layout(Layout.of(dp=2, cp=4, cp_impl="allgather")).startswith("dp 2 tp 1 pp 1 cp 4 allgather ep")
    rejected_ring = {c.layout for c in plan.rejected if c.layout.dims.cp > 1 and c.layout.options.cp_impl == "ring"}
    assert rejected_ring and any(c.layout.options.cp_impl == "allgather" for c in plan.rejected)
    for c in plan.feasible + plan.rejected:
        if c.layout.options.cp_impl == "allgather":
            twin = dataclasses.replace(c.layout, options=dataclasses.replace(c.layout.options, cp_impl="ring"))
            assert twin not in rejected_ring  # never evaluated: over the budget like its ring twin


def test_published_runs_count_what_their_stacks_had():
    """Llama 3's stack: 1F1B and interleaved, all-gather context parallelism (§3.3.2); DeepSeek-V3's: whatever the
    search tries (the ring and the all-gather; Ulysses is left to --explain)."""
    from minidist.plan.published import published_runs

    llama, *_, v3 = published_runs()
    for impl, had in (("ring", False), ("allgather", True), ("ulysses", False)):
        assert llama.had(Layout.of(cp=2, cp_impl=impl, schedule="interleaved", pp=2, microbatches=2)) == had
        assert v3.had(Layout.of(cp=2, cp_impl=impl)) == (impl != "ulysses")
    assert llama.had(Layout.of(pp=2, microbatches=2, schedule="1f1b"))
    dualpipev = Layout.of(pp=2, microbatches=4, schedule="dualpipev")
    assert not llama.had(dualpipev) and v3.had(dualpipev)


def test_deepseek_precision_keeps_fp32_gradients_and_bf16_moments():
    """`--kernels deepseek` (DeepSeek-V3 §3.3.3): gradients in fp32 (twice bf16's bytes), the master copy fp32 and
    the AdamW moments bf16 (8 bytes of optimizer state, not 12), named in the report; its own activations
    (`deepseek_saves`, fewer than Megatron's kernels keep), Megatron's under full recomputation (the blocks' inputs)."""
    from minidist.plan.rank_memory import BF16_DEEPSEEK, PRECISIONS, precision_words

    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2))
    lay = Layout.of(dp=2, ep=2, pp=2, microbatches=4, zero=1)
    ours, megatron = (estimate_memory(cfg, lay, 256, 1, p) for p in (BF16_DEEPSEEK, BF16_MEGATRON))
    assert ours.grads == pytest.approx(2 * megatron.grads)
    assert ours.optimizer == pytest.approx(megatron.optimizer * 8 / 12)
    assert ours.params == megatron.params and ours.activations < megatron.activations
    full = dataclasses.replace(lay, recompute="full")
    assert estimate_memory(cfg, full, 256, 1, BF16_DEEPSEEK).activations == \
        estimate_memory(cfg, full, 256, 1, BF16_MEGATRON).activations
    assert PRECISIONS["deepseek"] is BF16_DEEPSEEK and "fp32 gradients, 8 bytes" in precision_words(BF16_DEEPSEEK)
    assert "DeepSeek-V3's kernels' activations" in precision_words(BF16_DEEPSEEK)


def test_a_published_layout_that_fits_only_with_what_its_run_lacked_has_no_place_among_what_it_had():
    """`hold` places the published layout among the layouts its run's stack could run; one that fits only under
    schedules the stack lacked gets no place there (not its overall rank), and the table says so."""
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.published import PublishedRun, hold, table

    cfg, h100 = get_preset("tiny"), cluster_for_chip("H100-SXM", efficiency=None)
    plan = search(cfg, 8, 256, 64 * 1024, h100)
    every = ("1f1b", "interleaved", "zb1", "zbv", "dualpipev")
    runs = {lacked: PublishedRun("toy", "tiny", "H100-SXM", 8, 256, 256, dict(dp=4, tp=1, pp=2, cp=1, ep=1), 1.0,
                                 "a test", unavailable=lacked) for lacked in ((), every)}
    full, lacking = hold(runs[()], plan), hold(runs[every], plan)
    assert full.rank is not None and full.rank_available == full.rank  # the run had everything
    assert lacking.rank == full.rank and lacking.rank_available is None and lacking.available == 0
    assert table([lacking]).splitlines()[-1].endswith("| fits only with what it lacked |")


def test_elementwise_kernels_move_their_values_once_at_the_chips_memory_bandwidth():
    """Each element-wise operator reads its inputs and writes its outputs once, at the datasheet HBM bandwidth:
    Llama 3 8B's block by hand (norms, residual adds, RoPE on 32 query and 8 key heads, SwiGLU over 14,336), its
    split under TP 2 with sequence parallelism, DeepSeek-V3's MoE block (MLA's latent norms and rotary parts, the
    permutation and combine of top-8 rows, 9 experts' SwiGLU, whole on every tp rank); recomputation runs the
    forward's operators again; a chip without a bandwidth on record is not charged, and the report says so."""
    from minidist.hardware import chip
    from minidist.plan.cluster import cluster_for_chip, elementwise_source
    from minidist.plan.elementwise import block_values, elementwise_seconds

    cfg = get_preset("llama3-8b")
    d, f, rotated = 4096, 14336, (32 + 8) * 128
    assert block_values(cfg, Layout.of(), False) == (4 * d + 6 * d + 2 * rotated + 3 * f,
                                                      6 * d + 6 * d + 2 * rotated + 5 * f)
    split = block_values(cfg, Layout.of(tp=2, sequence_parallel=True), False)
    assert split == (10 * d / 2 + rotated + 3 * f / 2, 12 * d / 2 + rotated + 5 * f / 2)
    v3 = get_preset("deepseek-v3")
    d, k, rope, ranks = 7168, 8, 128 * 64 + 64, 1536 + 512
    width = 9 * 2048  # 8 routed experts and the shared one
    assert block_values(v3, Layout.of(tp=2), True) == (
        10 * d + 2 * (128 // 2 * 64 + 64) + 2 * ranks + 3 * k * d + d + 3 * width,
        12 * d + 2 * (128 // 2 * 64 + 64) + 3 * ranks + 3 * k * d + d + 5 * width)
    assert block_values(v3, Layout.of(), True)[0] == 10 * d + 2 * rope + 2 * ranks + 3 * k * d + d + 3 * width
    h100 = cluster_for_chip("H100-SXM", efficiency=None)
    assert h100.hbm_bandwidth == chip("H100-SXM").hbm_bandwidth == 3.35e12
    forward, backward = block_values(cfg, Layout.of(), False)
    for recompute, forwards in (("none", 1), ("full", 2), ("selective", 2)):
        seconds = elementwise_seconds(cfg, Layout.of(recompute=recompute), 1000, (3, 0), 2, h100.hbm_bandwidth)
        assert seconds == pytest.approx(1000 * 3 * (forwards * forward + backward) * 2 / 3.35e12)
    t = predict_step(cfg, Layout.of(dp=8), 8192, 64, h100, BF16_MEGATRON)
    bare = predict_step(cfg, Layout.of(dp=8), 8192, 64, dataclasses.replace(h100, hbm_bandwidth=0.0), BF16_MEGATRON)
    assert t.elementwise > 0 and bare.elementwise == 0 and t.compute == pytest.approx(bare.compute + t.elementwise)
    tpu = dataclasses.replace(h100, name="TPUv4", hbm_bandwidth=0.0)
    assert elementwise_source(tpu) == "not charged (no memory bandwidth on record for TPUv4)"


def test_all_to_all_kernels_on_their_own_sms_slow_dualpipevs_paired_compute(capsys):
    """`comm_sms` SMs run the expert all-to-all beside DualPipeV's paired compute (DeepSeek-V3 §3.2.2: 20 of 132):
    the paired share of the compute runs on the other SMs, 132/112 as long; a schedule without pairs, or a layout
    without an all-to-all, keeps its compute; the command line refuses a count the chip cannot spare, in one line."""
    from minidist.plan.cli import main
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.schedule_costs import paired_share
    from minidist.plan.step_time import check_comm_sms

    cfg = get_preset("tiny", n_layers=8, moe=dict(n_experts=8, top_k=2))
    h800 = cluster_for_chip("H800", efficiency=None)
    assert h800.sms == 132
    for schedule, ep in (("dualpipev", 4), ("1f1b", 4), ("dualpipev", 1)):
        lay = Layout.of(dp=4, pp=2, ep=ep, schedule=schedule, microbatches=8)
        plain, shared = (predict_step(cfg, lay, 256, 32, h800, BF16_MEGATRON, recipe=Recipe(comm_sms=n))
                         for n in (0, 20))
        paired = paired_share(schedule, 2, 8) if ep > 1 else 0.0
        assert shared.compute == pytest.approx(plain.compute * (1 + paired * 20 / 112))
        assert (shared.compute > plain.compute) == (schedule == "dualpipev" and ep > 1)
    with pytest.raises(ValueError, match="B200 has no SMs on record"):
        check_comm_sms(20, cluster_for_chip("B200"))
    args = ["--model", "tiny", "--gpus", "8", "--seq-len", "256", "--global-batch-tokens", "64K", "--top", "1"]
    assert main([*args, "--gpu", "H800", "--comm-sms", "20"]) == 0
    assert "on 20 of the 132 SMs" in capsys.readouterr().out
    assert main([*args, "--gpu", "H800", "--comm-sms", "132"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose 0 <= N < 132" in err
