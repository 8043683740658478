"""Grade chapter 12's exercises: the rank grid of five dimensions and a memory estimate per rank.

`pytest tests/exercises -k ch12` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
Oracles: `minidist.comm.topology` (coordinates, group_ranks), `minidist.plan.rank_memory.model_state_bytes` (on a small
MoE model's real parameter counts), the 1F1B schedule `minidist.parallel.pp.schedules` builds, and
`minidist.plan.gemm_table.training_gemms` (the training GEMMs of a forward, each timed at its own shape's rate).
"""

import random

import pytest
from grading import load

from minidist.comm.topology import ParallelDims, coordinates, group_ranks
from minidist.model import get_preset
from minidist.parallel import Layout
from minidist.parallel.pp.schedules import build_schedule
from minidist.plan.gemm_table import layer_gemms, training_gemms
from minidist.plan.rank_memory import (
    BF16_MIXED,
    FP32,
    activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    model_state_bytes,
    rank_params,
)

MODULE = "ch12_five_dimensions"
CHAPTER_GRID = dict(dp=2, tp=2, pp=2, cp=2, ep=2)
GROUPS = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")


def _grids():
    yield CHAPTER_GRID
    rng = random.Random(12)
    for _ in range(6):
        dp, cp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2])
        ep = rng.choice([e for e in (1, 2, 3, 4) if (dp * cp) % e == 0])
        yield dict(dp=dp, tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2, 3]), cp=cp, ep=ep)


def _coordinate_hint(got: dict, want: dict, grid: dict) -> str:
    """Name the slip that reproduces `got`."""
    ep, dp_cp = grid["ep"], want["dp_cp"]
    if got.get("dp_cp") == dp_cp and (got.get("ep"), got.get("edp")) == (dp_cp // (grid["dp"] * grid["cp"] // ep),
                                                                         dp_cp % (grid["dp"] * grid["cp"] // ep)):
        return (" — ep as the slowest part of dp_cp: ep varies fastest (dp_cp = edp_i·ep + ep_i), so that an ep "
                "group is ep consecutive replicas, the ranks nearest each other for the all-to-all")
    if {k: got.get(k) for k in ("pp", "dp", "cp", "tp")} != {k: want[k] for k in ("pp", "dp", "cp", "tp")}:
        return " — the grid is row-major over (pp, dp, cp, tp), tp fastest: divmod from pp inwards"
    if got.get("dp_cp") != dp_cp:
        return " — dp_cp = dp_i·cp + cp_i (cp is the faster of the two)"
    return ""


def test_ch12_rank_coordinates(impl: str) -> None:
    rank_coordinates = load(impl, MODULE, "rank_coordinates")
    for grid in [CHAPTER_GRID, *_grids()]:
        dims = ParallelDims(**grid)
        for rank in range(dims.world_size):
            want = {k: coordinates(dims, rank)[k] for k in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")}
            got = rank_coordinates(rank, **grid)
            assert got == want, f"{grid}, rank {rank}: got {got}, want {want}{_coordinate_hint(got, want, grid)}"


def test_ch12_group_members(impl: str) -> None:
    group_members = load(impl, MODULE, "group_members")
    for grid in [CHAPTER_GRID, *_grids()]:
        dims = ParallelDims(**grid)
        for name in GROUPS:
            for group in group_ranks(dims, name):
                for rank in group:
                    got = list(group_members(rank, name, **grid))
                    hint = ""
                    if name in ("ep", "edp") and len(got) == len(group):
                        hint = (" — ep groups are ep *consecutive* members of the dp_cp group (ep varies fastest: "
                                "dp_cp = edp_i·ep + ep_i), edp groups the members with equal ep index")
                    elif len(got) == 1 < len(group):
                        hint = " — did a dp or cp group require equal dp_cp? It changes whenever dp or cp does"
                    assert got == group, f"{grid}, rank {rank}, group {name}: got {got}, want {group}{hint}"


@pytest.mark.parametrize("precision", [BF16_MIXED, FP32], ids=["bf16-mixed", "fp32"])
def test_ch12_model_state_bytes(impl: str, precision) -> None:
    model_state = load(impl, MODULE, "model_state_bytes")
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2, first_dense_layers=1))
    for dp, cp, ep, tp, zero in [(4, 1, 2, 1, 1), (2, 2, 4, 2, 2), (8, 1, 8, 1, 3), (2, 1, 1, 2, 0)]:
        layout = Layout.of(dp=dp, cp=cp, ep=ep, tp=tp, zero=zero)
        counts = rank_params(cfg, layout)
        want = model_state_bytes(cfg, layout, precision)
        got = model_state(counts["dense"], counts["experts"], dp * cp, ep, zero, precision.param, precision.grad,
                          precision.optimizer)
        for part in want:
            hint = _state_hint(part, got[part], want[part], counts["dense"], counts["experts"], dp * cp, ep, zero,
                               getattr(precision, {"params": "param", "grads": "grad"}.get(part, part)))
            assert got[part] == pytest.approx(want[part]), f"{layout}: {part} got {got[part]}, want {want[part]}{hint}"
    # The docstring's example last, so that a slip above gets its hint rather than a bare mismatch here.
    got = model_state(1000, 4000, 4, 2, 1)
    assert got["optimizer"] == 27000 and got["params"] == 10000, (
        f"the docstring's example (1,000 dense, 4,000 expert parameters, dp_cp 4, ep 2, ZeRO-1): got {got}"
        + _state_hint("optimizer", got["optimizer"], 27000, 1000, 4000, 4, 2, 1, 12))


def _state_hint(part: str, got: float, want: float, dense: int, experts: int, dp_cp: int, ep: int, zero: int,
                per: int) -> str:
    """Name the slip whose figure equals `got`."""
    stage = {"optimizer": 1, "grads": 2, "params": 3}[part]
    shards = zero >= stage
    slips = {
        "experts divided by dp_cp: they are replicated over only dp_cp / ep ranks (ep splits the experts already)":
            per * (dense + experts) / dp_cp if shards else None,
        "experts not divided at all under ZeRO: they are sharded over their dp_cp / ep replicas":
            per * (dense / dp_cp + experts) if shards else None,
        f"{part} sharded at ZeRO-{zero}: ZeRO shards the optimizer from stage 1, gradients from 2, parameters at 3":
            per * (dense / dp_cp + experts / (dp_cp // ep)) if not shards else None,
        f"{part} not sharded at ZeRO-{zero}": per * (dense + experts) if shards else None,
    }
    for cause, figure in slips.items():
        if figure is not None and figure != want and got == pytest.approx(figure):
            return f" — {cause}"
    return ""


def test_ch12_in_flight_1f1b(impl: str) -> None:
    in_flight = load(impl, MODULE, "in_flight_1f1b")
    cases = {}  # (pp, m, stage) -> (got, the schedule's peak)
    for pp, m in [(2, 4), (4, 8), (4, 2), (3, 5), (1, 3), (5, 3)]:
        schedule = build_schedule("1f1b", pp, m)
        for stage in range(pp):
            live = peak = 0
            for action in schedule[stage]:
                if action.kind in ("F", "B"):
                    live += 1 if action.kind == "F" else -1
                    peak = max(peak, live)
            cases[pp, m, stage] = (in_flight(pp, m, stage), peak)
    wrong = [(key, got, peak) for key, (got, peak) in cases.items() if got != peak]
    if wrong:
        (pp, m, stage), got, peak = wrong[0]
        answers = {key: got for key, (got, _) in cases.items()}
        pytest.fail(f"in_flight_1f1b(pp={pp}, m={m}, stage={stage}): got {got}, the 1F1B schedule holds {peak} "
                    f"({len(wrong)} of {len(cases)} cases wrong)" + _in_flight_cause(answers), pytrace=False)


def _in_flight_cause(answers: dict[tuple[int, int, int], int]) -> str:
    """The likely cause: the plausible wrong formula that gives every one of the learner's answers."""
    causes = [(lambda pp, m, s: pp - s, " — with fewer micro-batches than stages only m exist: cap the count at m"),
              (lambda pp, m, s: min(pp - s - 1, m), " — that is the warm-up forwards alone: the steady state's first "
                                                    "forward runs before the first backward, add 1"),
              (lambda pp, m, s: min(s + 1, m), " — stages counted from the wrong end: stage 0 (the first) holds the "
                                               "most"),
              (lambda pp, m, s: m, " — that is AFAB (GPipe), which holds all m; 1F1B starts backwards after pp − stage "
                                   "forwards"),
              (lambda pp, m, s: min(pp, m), " — every stage would hold as many as the first: a later stage starts its "
                                            "backwards sooner")]
    return next((hint for formula, hint in causes
                 if all(formula(*key) == got for key, got in answers.items())), "")


# ------------------------------------------------------------------------------------------------------------------
# block_activation_bytes: against tensor accounting

MEASURED_SHAPES = [dict(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64),
                   dict(d_model=48, n_heads=6, n_kv_heads=6, d_ff=96),
                   dict(d_model=64, n_heads=8, n_kv_heads=1, d_ff=160)]


def _measured_block(shape: dict, batch: int, seq: int) -> tuple[object, int]:
    """The bytes autograd saves in one real block of a one-layer model (fp32), by tensor accounting."""
    import torch

    from minidist.memory import PeakSavedBytes
    from minidist.model import build_model
    cfg = get_preset("tiny", n_layers=1, vocab_size=64, max_seq_len=seq, **shape)
    model = build_model(cfg, seed=0)
    x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
    rope = model.rotary(torch.arange(seq))
    with PeakSavedBytes(params=list(model.parameters()), exclude=list(rope)) as counted:
        model.blocks[0](x, rope)
    return cfg, counted.peak


def _activation_hint(got: float, cfg, tokens: int, tp: int, sp: bool, p: int) -> str:
    from grading import explain
    heads, shard = cfg.n_heads // tp, (tp if sp and tp > 1 else 1)
    pieces = {"the attention kernel's fp32 log-sum-exp, one per (token, head)": 4 * tokens * heads,
              "the norms' fp32 1/rms (one per token, two norms)": 8 * tokens / shard,
              "the norms' fp32 inputs": 8 * tokens * cfg.d_model / shard,
              "the attention output (wo's input)": p * tokens * heads * cfg.head_dim,
              "q or k before RoPE": p * tokens * heads * cfg.head_dim,
              "one of SwiGLU's four hidden tensors": p * tokens * cfg.d_ff / tp}
    return explain(got - block_reference(cfg, tokens, tp, sp, p), pieces)


def block_reference(cfg, tokens: int, tp: int, sp: bool, p: int) -> float:
    return layer_activation_bytes(cfg, 0, tokens, Layout.of(tp=tp, sequence_parallel=sp), p)


@pytest.mark.parametrize("shape", MEASURED_SHAPES,
                         ids=lambda s: "d{d_model}-h{n_heads}-kv{n_kv_heads}-ff{d_ff}".format(**s))
def test_ch12_block_activation_bytes_matches_tensor_accounting(impl: str, shape: dict) -> None:
    block_bytes = load(impl, MODULE, "block_activation_bytes")
    cfg, measured = _measured_block(shape, batch=2, seq=16)
    got = block_bytes(32, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, 4)
    assert got == pytest.approx(measured), (
        f"block_activation_bytes, {shape}, 32 tokens, fp32: {got:,.0f} bytes, tensor accounting measured "
        f"{measured:,.0f}{_activation_hint(got, cfg, 32, 1, False, 4)}")


@pytest.mark.parametrize("tp,sp,p", [(2, False, 4), (2, True, 4), (4, True, 2), (4, False, 2)],
                         ids=["tp2", "tp2-sp", "tp4-sp-bf16", "tp4-bf16"])
def test_ch12_block_activation_bytes_under_tp_and_sp(impl: str, tp: int, sp: bool, p: int) -> None:
    block_bytes = load(impl, MODULE, "block_activation_bytes")
    cfg = get_preset("tiny", n_layers=1, vocab_size=64, max_seq_len=32, **MEASURED_SHAPES[2])
    want = block_reference(cfg, 64, tp, sp, p)
    got = block_bytes(64, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, p, tp, sp)
    hint = _activation_hint(got, cfg, 64, tp, sp, p)
    if not hint and sp and got == pytest.approx(block_reference(cfg, 64, tp, False, p)):
        hint = " — the same as without SP: under SP the norms (and their fp32 statistics) hold tokens/tp tokens"
    assert got == pytest.approx(want), (
        f"block_activation_bytes, tp {tp}, sp {sp}, {p}-byte activations, 64 tokens: {got:,.0f}, expected "
        f"{want:,.0f}{hint}")


@pytest.mark.parametrize("sp", [False, True], ids=["full-recompute", "full-recompute-sp"])
def test_ch12_block_activation_bytes_with_full_recompute(impl: str, sp: bool) -> None:
    block_bytes = load(impl, MODULE, "block_activation_bytes")
    cfg = get_preset("tiny", n_layers=1, vocab_size=64, max_seq_len=32, **MEASURED_SHAPES[0])
    layout = Layout.of(tp=2, sequence_parallel=sp, recompute="full")
    want = activation_bytes(cfg, layout, 64, 1)[0] - 8 * 64 - head_activation_bytes(cfg, 64, layout, 4)
    got = block_bytes(64, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, 4, 2, sp, "full")
    assert got == pytest.approx(want), (
        f"block_activation_bytes, full recompute, tp 2, sp {sp}: {got:,.0f}, expected {want:,.0f} — a recomputed "
        "block keeps only its input, p·tokens·d_model" + (", on the sequence shard under SP (÷ tp)" if sp else ""))


# ------------------------------------------------------------------------------------------------------------------
# linear_training_seconds: against the planner's GEMM list and its FLOP-weighted rate


def _rate_of(m: int, k: int, n: int) -> float:
    """FLOP/s that differ for every permutation of a shape, so that a transposed GEMM shows."""
    return 1e12 * (1 + m / 1e4) * (1 + 2 * k / 1e4) * (1 + 3 * n / 1e4)


def _seconds(gemms) -> float:
    return sum(count * 2.0 * m * k * n / _rate_of(m, k, n) for (m, k, n), _, count in gemms)


def _linear_hint(got: float, forward, recompute: bool) -> str:
    """Name the slip that reproduces `got`."""
    as_forward = [((m, k, n), 0, c * (3 + recompute)) for (m, k, n), c in forward]
    swapped = [g for (m, k, n), c in forward
               for g in (((m, k, n), 0, c * (1 + recompute)), ((m, n, k), 0, c), ((m, k, n), 0, c))]
    flops = sum(2.0 * m * k * n * c * (3 + recompute) for (m, k, n), c in forward)
    mean_rate = sum(_rate_of(*s) for s, _ in forward) / len(forward)
    for seconds, hint in ((_seconds(as_forward), "every backward GEMM timed at the forward's shape: dX = dY·Wᵀ is "
                           "(m, n, k), dW = Xᵀ·dY is (k, m, n), its reduction over the m tokens"),
                          (_seconds(swapped), "the weight gradient timed as (m, k, n): Xᵀ is k×m, so dW = Xᵀ·dY is "
                           "(k, m, n), a GEMM that reduces over the tokens"),
                          (_seconds(training_gemms(forward, 1)), "full recomputation runs each forward GEMM twice"),
                          (flops / mean_rate, "FLOPs over the mean rate: sum each GEMM's FLOPs over its own rate")):
        if got == pytest.approx(seconds, rel=1e-9):
            return f" — {hint}"
    return ""


@pytest.mark.parametrize("recompute", [False, True])
def test_ch12_linear_training_seconds(impl: str, recompute: bool) -> None:
    seconds_of = load(impl, MODULE, "linear_training_seconds")
    cases = {"one square GEMM": [((4096, 4096, 4096), 1.0)],
             "Llama 3 8B's attention and MLP on a tp-2 rank, 2,048 tokens":
                 [(shape, count) for shape, count in layer_gemms(get_preset("llama3-8b"), 2, 2048, 0.0)["dense"]],
             "narrow and wide": [((1024, 128, 8192), 2.0), ((8192, 8192, 128), 1.0)]}
    for name, forward in cases.items():
        want = _seconds(training_gemms(forward, 2 if recompute else 1))
        got = seconds_of([(m, k, n, c) for (m, k, n), c in forward], _rate_of, recompute)
        assert got == pytest.approx(want, rel=1e-9), \
            f"{name}, recompute={recompute}: got {got:.6g} s, want {want:.6g}" + _linear_hint(got, forward, recompute)
