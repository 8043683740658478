"""Chapter 07, ZeRO stages 0-3: parity with one device, ledger bytes and memory against the paper's formulas,
global-norm clipping across shards, exact resume from checkpoints.

Every multi-process case runs inside one launch per world size (tests/dp_cases.py), shared with
test_data_parallel.py.
"""

from __future__ import annotations

import functools

import dp_cases
import parity
import pytest
import torch

from minidist.comm.communicator import Comm, ring_bytes_sent
from minidist.model import build_model, lm_loss
from minidist.parallel import ZeroOptimizer, clip_grad_norm_, placement_of, zero_comm_bytes, zero_memory_bytes
from minidist.parallel.dp.zero import ELEMENTWISE_OPTIMIZERS

WORLDS = (2, 4)
STAGES = (0, 1, 2, 3)
MICRO = (1, 2)



def mean_losses(world: int, case: str) -> list[float]:
    per_rank = [r[case]["losses"] for r in dp_cases.results(world)]
    return [sum(step) / world for step in zip(*per_rank)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("micro", MICRO)
def test_parity_with_one_device(world: int, stage: int, micro: int) -> None:
    """Losses of 3 steps (clipping active) and the step-0 gradient, assembled from shards by name."""
    case = f"zero{stage}_m{micro}"
    reference = parity.reference_run()
    parity.assert_losses_match(mean_losses(world, case), reference["losses"], f"dp={world} {case}")
    parity.assert_grads_match(dp_cases.results(world)[0][case]["grads"], reference["grads"], f"dp={world} {case}")


@pytest.mark.parametrize("stage", (2, 3))
def test_parity_without_overlap(stage: int) -> None:
    """overlap=False at stages 2-3, 2 micro-batches, dp=2: every bucket is reduce-scattered once backward ends (the
    full buckets cannot wait for the step: they are freed every micro-batch). Losses, the step-0 gradient and the
    norms are the single-device run's; no collective starts during backward."""
    case = f"zero{stage}_m2_no_overlap"
    reference = parity.reference_run()
    parity.assert_losses_match(mean_losses(2, case), reference["losses"], f"dp=2 {case}")
    parity.assert_grads_match(dp_cases.results(2)[0][case]["grads"], reference["grads"], f"dp=2 {case}")
    for r in dp_cases.results(2):
        out = r[case]
        assert out["norms"] == pytest.approx(reference["grad_norms"], rel=1e-6)
        # Step 0, per micro-batch: every gradient, the end of backward, then every bucket's reduce-scatter.
        kinds = [kind for kind, _, _ in out["timeline"] if kind in ("grad", "backward_end", "launch")]
        micro_batch = ["grad"] * len(reference["grads"]) + ["backward_end"] + ["launch"] * out["buckets"]
        assert kinds == 2 * micro_batch


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_global_grad_norm_across_shards(world: int, stage: int) -> None:
    """The norm each rank reports (sum of its shard's squares, all-reduced) is the single-device norm."""
    reference = parity.reference_run()["grad_norms"]
    for r in dp_cases.results(world):
        for got, want in zip(r[f"zero{stage}_m1"]["norms"], reference, strict=True):
            assert got == pytest.approx(want, rel=1e-6)


@functools.cache
def moe_reference() -> dict:
    """One process on the MoE model: losses and gradient norms (the package's fp64 norm) of the parity steps."""
    model = build_model(dp_cases.MOE_CFG, seed=parity.SEED)
    optimizer = parity.make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(parity.STEPS):
        inputs, targets = parity.global_batch(step)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        pieces = [(p.grad, placement_of(p)) for p in model.parameters() if p.grad is not None]
        norms.append(float(clip_grad_norm_(pieces, parity.GRAD_CLIP, {})))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def test_zero2_grad_norm_of_an_moe_model_is_the_one_process_norm(one_thread) -> None:
    """dp=2, ZeRO-2, MoE blocks, clipping active: every step's reported norm (each rank's shard pieces, squares
    summed in fp64 over dp_cp) is the one-process norm to 1e-6, and the losses follow the one-process run."""
    reference = moe_reference()
    assert reference["norms"][0] > parity.GRAD_CLIP  # the clipping is active, so later steps depend on the norm
    for r in dp_cases.results(2):
        out = r["zero2_moe"]
        for got, want in zip(out["norms"], reference["norms"], strict=True):
            assert got == pytest.approx(want, rel=1e-6)
    parity.assert_losses_match(mean_losses(2, "zero2_moe"), reference["losses"], "dp=2 zero2 MoE")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_replicas_agree(world: int, stage: int) -> None:
    hashes = {r[f"zero{stage}_m2"]["replica_hash"] for r in dp_cases.results(world)}
    assert len(hashes) == 1, hashes


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("micro", MICRO)
def test_ledger_bytes_per_step(world: int, stage: int, micro: int) -> None:
    """Ring formulas with M = 4·Ψ' bytes (Ψ' = padded elements, N | Ψ'): all-reduce 2(N-1)/N·M; reduce-scatter and
    all-gather (N-1)/N·M each. Stage 0 all-reduces once per step; 1 reduce-scatters once and all-gathers the
    update; 2 reduce-scatters every micro-batch; 3 all-gathers twice and reduce-scatters once per micro-batch."""
    case = f"zero{stage}_m{micro}"
    one = lambda padded: (world - 1) * padded * 4 // world  # noqa: E731
    want = {0: {"all_reduce": 2}, 1: {"reduce_scatter": 1, "all_gather": 1},
            2: {"reduce_scatter": micro, "all_gather": 1}, 3: {"reduce_scatter": micro, "all_gather": 2 * micro}}
    for rank, r in enumerate(dp_cases.results(world)):
        out = r[case]
        assert 0 <= out["padded"] - out["numel"] < world * out["buckets"]
        for entry in out["ledger"][1:]:  # step 0 also gathers the gradient for the parity check
            got = {op: v["bytes"] for (op, group), v in entry.items() if group == "dp_cp"}
            norm = got.pop("all_reduce") if stage > 0 else 0
            assert got == {op: k * one(out["padded"]) for op, k in want[stage].items()}, f"{case} rank {rank}"
            if stage > 0:  # plus one fp64 scalar all-reduce: the global gradient norm over the shards
                assert norm == ring_bytes_sent("all_reduce", (), 8, world, rank)
                assert entry[("all_reduce", "dp_cp")]["calls"] == 1
            formula = zero_comm_bytes(out["padded"], world, stage, micro)
            assert got == pytest.approx(formula)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_memory_per_rank_matches_the_formula(world: int, stage: int) -> None:
    """Bytes of the storages each rank holds after a step, against (P + G + K)·Ψ with fp32 P = G = 4, Adam K = 8.

    Two exact corrections: flat buffers carry Ψ' >= Ψ elements (padding), and AdamW keeps a 4-byte step counter per
    tensor it updates (`pieces`).
    """
    results = dp_cases.results(world)
    optimizer_total = 0
    for r in results:
        out = r[f"zero{stage}_m1"]
        psi, padded, mem = out["numel"], out["padded"], out["memory"]
        params_psi = {0: psi, 1: padded, 2: padded, 3: padded / world}[stage]
        grads_psi = padded if stage <= 1 else padded / world
        assert mem["params"] == 4 * params_psi
        assert mem["grads"] == 4 * grads_psi
        optimizer_total += mem["optimizer"] - 4 * out["pieces"]
        total = mem["params"] + mem["grads"] + mem["optimizer"]
        formula = zero_memory_bytes(psi, world, stage, optimizer_bytes_per_param=8, param_bytes=4, grad_bytes=4)
        assert total == pytest.approx(formula, rel=0.02)
    # The optimizer shards partition the 8Ψ bytes of Adam's moments exactly.
    assert optimizer_total == 8 * results[0]["zero0_m1"]["numel"] * (world if stage == 0 else 1)


@pytest.mark.parametrize("world", WORLDS)
def test_zero3_gathers_just_in_time(world: int) -> None:
    """Stage 3 never holds the whole model: at most the root unit (embeddings, head), the block computing and the
    block prefetched are gathered. Gradient buckets: the root's (its gradients arrive first and last), the block's
    being filled and one in flight."""
    for r in dp_cases.results(world):
        out = r["zero3_m1"]
        root, *blocks = reversed(out["unit_bytes"])  # units are in backward order: blocks last to first, then root
        peak = out["peak_transient"]
        assert 0 < peak["gathered_params"] <= root + 2 * max(blocks) < 4 * out["numel"]
        assert 0 < peak["grad_buckets"] <= root + 2 * max(blocks) < 4 * out["numel"]


def test_zero_memory_formula_reproduces_the_paper() -> None:
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB."""
    psi = 7.5e9
    got = [zero_memory_bytes(psi, 64, s) / 1e9 for s in STAGES]
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.06)
    assert zero_memory_bytes(psi, 1, 3) == zero_memory_bytes(psi, 1, 0) == 16 * psi
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zero_memory_bytes(psi, 8, 4)


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_resume_is_exact(stage: int) -> None:
    """Save after 2 steps, continue 1; rebuild from the save and redo the step: same loss and parameters, bitwise."""
    for r in dp_cases.results(2):
        out = r[f"checkpoint_zero{stage}"]
        assert out["first"] == out["again"]
        assert out["same_params"]
        assert out["refused"].startswith("this ZeRO state was saved with layout stage") and "\n" not in out["refused"]


def test_trainer_matches_one_process_and_resumes_exactly(tmp_path, one_thread) -> None:
    """`minidist.train.loop` at dp=2, ZeRO 0-3, 2 micro-batches: the logged losses are the single-process run's; a run
    resumed from its step-2 checkpoint redoes steps 3-4 bit for bit, and the replicas agree on the parameters."""
    from minidist.train import loop as train

    single = train.train(dp_cases.trainer_config(str(tmp_path / "single"), ckpt_every=0))
    for stage in STAGES:
        per_rank = [r["trainer"][stage] for r in dp_cases.results(2)]
        for out in per_rank:
            parity.assert_losses_match(out["losses"], single["losses"], f"trainer dp=2 zero={stage}")
            assert out["resumed_from"] == 2
            assert out["resumed_losses"] == out["losses"][2:]
            assert out["resumed_hash"] == out["hash"]
        assert len({out["hash"] for out in per_rank}) == 1


class _RootlessStack(torch.nn.Module):
    """Blocks only, no parameters outside them (like a middle pipeline stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize("stage", STAGES)
def test_single_rank_zero_is_plain_adamw(stage: int, one_thread) -> None:
    """One rank (no process group): every stage trains exactly like torch.optim.AdamW with clip_grad_norm_."""
    model, twin = build_model(parity.CFG, seed=5), build_model(parity.CFG, seed=5)
    zero = ZeroOptimizer(model, parity.make_optimizer(model.parameters()), Comm(), stage, bucket_bytes=16 * 1024)
    optimizer = parity.make_optimizer(twin.parameters())
    for step in range(2):
        inputs, targets = parity.global_batch(step)
        lm_loss(model(inputs), targets).backward()
        lm_loss(twin(inputs), targets).backward()
        norm = zero.clip_grad_norm(parity.GRAD_CLIP)
        assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(twin.parameters(), parity.GRAD_CLIP).item(),
                                     rel=1e-5)
        zero.step()
        zero.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    full = zero.full_parameters()
    assert list(full) == [n for n, _ in twin.named_parameters()]
    for name, p in twin.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-7, msg=name)


def _step_side_by_side(model: torch.nn.Module, zero: ZeroOptimizer, twin: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Train `model` under `zero` and `twin` under the plain `optimizer` on the same inputs."""
    x = torch.randn(5, 8)
    for _ in range(steps):
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
        zero.step()
        zero.zero_grad()
        optimizer.step()
        optimizer.zero_grad()


def test_zero3_without_root_parameters(one_thread) -> None:
    model, twin = _RootlessStack(), _RootlessStack()
    twin.load_state_dict(model.state_dict())
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False), Comm(), 3)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=0.1, foreach=False)
    _step_side_by_side(model, zero, twin, optimizer)
    assert all(p.numel() == 0 for p in model.parameters())  # sharded and freed between steps
    for name, p in twin.named_parameters():
        torch.testing.assert_close(zero.full_parameters()[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_non_elementwise_optimizers_are_refused_when_sharded(stage: int) -> None:
    """Adafactor factors a matrix's second moment by rows and columns, so its update of one slice depends on the
    others: sharded by elements it would train differently from one device. Refused in one line naming what works;
    stage 0 (nothing sharded) takes it. AdamW is accepted (every parity test above trains with it)."""
    model = _RootlessStack()
    with pytest.raises(ValueError) as refused:
        ZeroOptimizer(model, torch.optim.Adafactor(model.parameters()), Comm(), stage)
    assert str(refused.value) == (
        f"ZeRO stage {stage} shards each parameter's optimizer state by elements, which is exact only for "
        "elementwise optimizers (Adadelta, Adagrad, Adam, Adamax, AdamW, ASGD, NAdam, RAdam, RMSprop, Rprop, SGD); "
        "Adafactor is not: use stage 0")
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), Comm(), stage)
    assert type(zero.optimizer) is torch.optim.AdamW


def test_stage0_takes_any_optimizer(one_thread) -> None:
    """Stage 0 is data parallelism plus the caller's optimizer as it is: Adafactor trains like one device."""
    model, twin = _RootlessStack(), _RootlessStack()
    twin.load_state_dict(model.state_dict())
    zero = ZeroOptimizer(model, torch.optim.Adafactor(model.parameters(), lr=0.1), Comm(), 0)
    optimizer = torch.optim.Adafactor(twin.parameters(), lr=0.1)
    _step_side_by_side(model, zero, twin, optimizer)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("cls", [*ELEMENTWISE_OPTIMIZERS, torch.optim.Adafactor], ids=lambda c: c.__name__)
def test_allowed_optimizers_are_elementwise(cls: type) -> None:
    """What ZeRO relies on: stepping a matrix cut into uneven flat slices (as ZeRO's shards cut it) gives exactly
    the update of stepping it whole. Adafactor, which ZeRO refuses, is the control: it differs."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(8, 6, generator=gen)
    grads = [torch.randn(8, 6, generator=gen) for _ in range(4)]
    options = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    whole = start.clone().requires_grad_()
    cuts = [(0, 7), (7, 30), (30, 48)]
    slices = [start.flatten()[a:b].clone().requires_grad_() for a, b in cuts]
    whole_optimizer, sliced_optimizer = cls([whole], **options), cls(slices, **options)
    for grad in grads:
        whole.grad = grad.clone()
        for piece, (a, b) in zip(slices, cuts):
            piece.grad = grad.flatten()[a:b].clone()
        whole_optimizer.step()
        sliced_optimizer.step()
    sliced = torch.cat([s.detach() for s in slices]).view(8, 6)
    assert torch.equal(sliced, whole.detach()) == (cls in ELEMENTWISE_OPTIMIZERS)


def test_template_that_has_stepped_is_refused(one_thread) -> None:
    """The sharded optimizer starts from empty state, so a template that already stepped would lose its moments.
    Adagrad's state filled at construction (step 0) is not a step: accepted."""
    model = _RootlessStack()
    ZeroOptimizer(model, torch.optim.Adagrad(model.parameters()), Comm(), 1)
    stepped = torch.optim.AdamW(_RootlessStack().parameters())
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    with pytest.raises(ValueError, match="^the template optimizer has already taken a step"):
        ZeroOptimizer(model, stepped, Comm(), 1)


# ---------------------------------------------------------------------------------------------------------------
# The communication precision policy: ZeRO-3's gathers in bf16
# ---------------------------------------------------------------------------------------------------------------


def _zero3_gather_run(gather_dtype: torch.dtype) -> dict:
    """Two ZeRO-3 steps of the parity setup on this rank, gathering in `gather_dtype`: the ledger of the second
    step, the gathered units' peak bytes, the losses and the dtypes the forward saw and the optimizer updates."""
    import torch.distributed as dist

    from minidist.comm.communicator import Ledger
    from minidist.comm.topology import ParallelDims, Topology
    from minidist.parallel import split_batch
    from minidist.precision import CommPrecision

    topo = Topology(ParallelDims(dp=dist.get_world_size()), dist.get_rank(), dist.get_world_size())
    ledger = Ledger()
    model = build_model(parity.CFG, seed=parity.SEED)
    zero = ZeroOptimizer(model, parity.make_optimizer(model.parameters()), topo.comm("dp_cp", ledger), 3,
                         comm_precision=CommPrecision(gather_dtype=gather_dtype))
    seen, losses, per_step = set(), [], []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.add(m.attn_norm.weight.dtype))
    for step in range(2):
        before = ledger.totals()
        (x, y), = split_batch(*parity.global_batch(step), topo.coord("dp_cp"), topo.size("dp_cp"))
        loss = lm_loss(model(x), y)
        loss.backward()
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
        after = ledger.totals()
        per_step.append({op: v["bytes"] - before.get((op, g), {}).get("bytes", 0) for (op, g), v in after.items()})
    return {"ledger": per_step[1], "peak": zero.peak_transient_bytes()["gathered_params"], "losses": losses,
            "padded": zero.padded_numel, "seen": seen, "master": {b.param_shard.dtype for b in zero.buckets},
            "at_rest": {p.dtype for p in model.parameters()}}


def test_bf16_gathers_move_half_the_bytes_and_keep_fp32_masters() -> None:
    from minidist.comm.launch import run_ranks

    world = 2
    fp32, bf16 = (run_ranks(_zero3_gather_run, world, dtype, timeout=300) for dtype in (torch.float32,
                                                                                         torch.bfloat16))
    for a, b in zip(fp32, bf16):
        assert b["ledger"]["all_gather"] * 2 == a["ledger"]["all_gather"]  # half the bytes of every gather
        assert b["ledger"]["reduce_scatter"] == a["ledger"]["reduce_scatter"]  # gradients still reduced in fp32
        for run, size in ((a, 4), (b, 2)):
            formula = zero_comm_bytes(run["padded"], world, 3, element_size=4, gather_element_size=size)
            assert run["ledger"]["all_gather"] == pytest.approx(formula["all_gather"])
            assert run["ledger"]["reduce_scatter"] == pytest.approx(formula["reduce_scatter"])
        assert b["peak"] * 2 == a["peak"]  # the gathered units, what the memory accounting counts, halve too
        assert (a["seen"], b["seen"]) == ({torch.float32}, {torch.bfloat16})  # what the forward computes with
        assert a["master"] == b["master"] == a["at_rest"] == b["at_rest"] == {torch.float32}
        assert b["losses"][0] == pytest.approx(a["losses"][0], rel=1e-2)  # bf16-rounded weights, same model
        assert b["losses"][1] == pytest.approx(a["losses"][1], rel=2e-2)
