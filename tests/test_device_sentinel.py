"""Every trainer layout under the device sentinel (tests/device_sentinel.py): a tensor made without `device=` is on
the meta device while the ranks compute on the CPU, so it fails at its first use, as a CPU tensor would on a GPU
with NCCL. One covering set of layouts, each 2 steps of a tiny model through `train(cfg)` with the replica check
after every step (--check-every 1) and an evaluation at the end: dp with ZeRO 0-3, tp with sp, pp with each
schedule, cp with each implementation, ep, a tied embedding across pipeline stages, the MoE router bias (summed
over replicas), and a checkpoint and its resume. One launch per world size (2 and 4); each layout also logs what
the one-process run logs (losses, gradient norms, the validation loss, MoE's balancing loss), so the run under the
sentinel is a parity run too.

On the code before issue 24's fixes every layout failed, first at the rank grid; with the other fixes in place,
each one left out failed: the parameters' initial values and RoPE's frequencies (every layout), the data sampler
(every layout: torch alone indexes the corpus with meta offsets and returns garbage rows), the replica check's
hashes (every layout with a replicated tensor: "all_gather on dp_cp: a tensor (1,) on meta, but this Comm expects
cpu", on NCCL "No backend type associated with device type cpu"), the pipeline's loss sum (pp), MoE's step
statistics (MoE) and the checkpoint's runs (the checkpointed run). Host-side bookkeeping now says device="cpu".
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import trainer_parity
from device_sentinel import device_sentinel

from minidist.comm.communicator import Comm
from minidist.comm.launch import run_ranks
from minidist.train import checkpoint
from minidist.train import loop as train
from minidist.train.config import TrainConfig

DENSE = {"n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 32}
# dropless experts with the aux-free router bias (its counts are summed over replicas), and a tied embedding
MOE = dict(DENSE, tie_embeddings=True, moe={"n_experts": 4, "top_k": 2, "bias_update_speed": 0.05})
RESUME = "tp2 dp2 zero1 resumed"  # also checkpointed after each step, then resumed from step 1

# world size: {name: (model kind, the layout's settings)}
LAYOUTS = {
    2: {
        "dp2 zero0": ("dense", dict(dp=2)),
        "dp2 zero1": ("dense", dict(dp=2, zero=1)),
        "dp2 zero2": ("dense", dict(dp=2, zero=2)),
        "dp2 zero3": ("dense", dict(dp=2, zero=3)),
        "tp2 sp": ("dense", dict(tp=2, sp=True)),
        "pp2 afab": ("dense", dict(pp=2, schedule="afab")),
        "pp2 1f1b": ("dense", dict(pp=2, schedule="1f1b")),
        "pp2 interleaved": ("dense", dict(pp=2, schedule="interleaved", virtual_stages=2)),
        "cp2 ring": ("dense", dict(cp=2, cp_impl="ring")),
        "cp2 allgather": ("dense", dict(cp=2, cp_impl="allgather")),
        "cp2 ulysses": ("dense", dict(cp=2, cp_impl="ulysses")),
        "moe dp2 ep2": ("moe", dict(dp=2, ep=2)),
        "moe tied pp2": ("moe", dict(pp=2, schedule="1f1b")),
        "doc-mask cp2 ring": ("docs", dict(cp=2, cp_impl="ring")),  # document ids made on the host, sent with rows
        "doc-mask pp2 1f1b": ("docs", dict(pp=2, schedule="1f1b")),
    },
    4: {
        RESUME: ("dense", dict(tp=2, dp=2, zero=1, ckpt_every=1)),
        "tp2 sp dp2 zero3": ("dense", dict(tp=2, sp=True, dp=2, zero=3)),
        "moe tied pp2 dp2 ep2 zero2": ("moe", dict(pp=2, dp=2, ep=2, zero=2, schedule="afab")),
        "moe dp2 cp2 ep4 zero3": ("moe", dict(dp=2, cp=2, ep=4, zero=3, cp_impl="allgather")),
    },
}


def config(out: str, kind: str, **changes) -> TrainConfig:
    """2 steps of batch 8 x 16 in 2 micro-batches, clipping active, the replica check after every step, one
    evaluation (at the last step), no checkpoint unless asked. Kind "docs": the dense model with --doc-mask."""
    settings = dict(model="tiny", model_overrides=dict(MOE if kind == "moe" else DENSE), max_bytes=50_000,
                    doc_mask=kind == "docs",
                    batch_size=8, seq_len=16, microbatches=2, steps=2, warmup_steps=1, grad_clip=1.0, eval_every=0,
                    eval_batches=1, log_every=100, ckpt_every=0, check_every=1, out=out, seed=0, peak_flops=1e12,
                    plot=False)
    return TrainConfig(**{**settings, **changes})


def _resume(root: str) -> dict:
    """The checkpointed run again from its step-1 checkpoint, as if it had died after it."""
    out = Path(root) / RESUME.replace(" ", "_")
    if dist.get_rank() == 0:
        ckpts = out / "checkpoints"
        shutil.rmtree(ckpts / checkpoint.step_dir_name(2))
        (ckpts / checkpoint.LATEST).write_text(checkpoint.step_dir_name(1) + "\n")
    dist.barrier()
    kind, settings = LAYOUTS[4][RESUME]
    again = train.train(config(str(out), kind, **settings, resume=True))
    return {"losses": again["losses"], "resumed_from": again["resumed_from"], "hash": again["param_hash"]}


def _rank_layouts(root: str, world: int) -> dict:
    """The rank function: every layout of this world size under the sentinel, then the resume if it is here."""
    layouts = {name: dict(settings, kind=kind) for name, (kind, settings) in LAYOUTS[world].items()}
    with device_sentinel():
        results = trainer_parity.train_layouts(root, layouts, config)
        if RESUME in layouts:
            results["resume"] = _resume(root)
    return results


@functools.lru_cache(maxsize=2)
def _results(root: str, world: int) -> list[dict]:
    return run_ranks(_rank_layouts, world, root, world, timeout=300, threads_per_rank=1,
                     case=f"device sentinel, {world} ranks")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sentinel"))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """The one-process run of each model, without the sentinel."""
    return {kind: trainer_parity.single_process_records(str(tmp_path_factory.mktemp(kind)),
                                                        functools.partial(config, kind=kind))
            for kind in ("dense", "moe", "docs")}


def assert_matches(name: str, records: list[dict], reference: list[dict]) -> None:
    """Steps, losses, gradient norms (before clipping), the validation loss and MoE's balancing loss."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    steps = [r["step"] + 1 for r in reference]
    for key in ("loss", "grad_norm", "val_loss", "aux_loss"):
        got, want = [r.get(key) for r in records], [r.get(key) for r in reference]
        if all(w is None for w in want):
            continue
        kept = [(g, w, s) for g, w, s in zip(got, want, steps) if w is not None]
        same_steps = [g is None for g in got] == [w is None for w in want]
        assert same_steps and trainer_parity.close(*map(list, zip(*kept))), f"{name}: {key} {got} != one process {want}"


@pytest.mark.parametrize("world, name", [(w, n) for w, layouts in LAYOUTS.items() for n in layouts])
def test_layout_runs_under_the_sentinel_and_matches_one_process(world, name, root, references) -> None:
    results = _results(root, world)
    assert_matches(name, results[0][name]["records"], references[LAYOUTS[world][name][0]])
    for r in results:  # every rank reports the same (global) losses
        assert r[name]["losses"] == results[0][name]["losses"]
    assert references["dense"][0]["grad_norm"] > 1.0  # clipping was active: a wrong norm changes the second loss


def test_the_checkpointed_run_resumes_exactly_under_the_sentinel(root) -> None:
    for r in _results(root, 4):
        assert r["resume"]["resumed_from"] == 1
        assert r["resume"]["losses"] == r[RESUME]["losses"][1:]
        assert r["resume"]["hash"] == r[RESUME]["hash"]  # this rank's parameters, bit for bit


def test_one_process_under_the_sentinel_logs_what_it_logs_without(tmp_path, references, one_thread) -> None:
    with device_sentinel():
        train.train(config(str(tmp_path), "moe"))
    records = trainer_parity.records(str(tmp_path))
    for key in ("loss", "grad_norm", "val_loss", "aux_loss"):  # the same process and code: the same bits
        assert [r.get(key) for r in records] == [r.get(key) for r in references["moe"]], key


def test_the_sentinel_makes_a_tensor_without_device_fail_at_its_first_use() -> None:
    compute = torch.ones(4, device="cpu")
    with device_sentinel():
        stray = torch.zeros(4)  # no device=: on a GPU this is a CPU tensor
        assert stray.is_meta and torch.zeros(4, device="cpu").device.type == "cpu"
        with pytest.raises(RuntimeError, match="made without device="):
            compute + stray
        with pytest.raises(RuntimeError, match="made without device="):
            compute[torch.arange(2)]  # torch alone would index with meta indices and return garbage
        with pytest.raises(RuntimeError):
            stray.sum().item()
    assert torch.zeros(1).device.type == "cpu"  # the block's end restores the default device


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "isend",
                                "irecv", "exchange", "post_unrecorded"])
def test_a_comm_with_a_device_refuses_a_tensor_elsewhere_in_every_call(op) -> None:
    """One rank, so nothing communicates: the check comes before any call into torch.distributed."""
    comm = Comm(name="dp", expect_device="cpu")
    stray = torch.zeros(2, device="meta")
    call = {"isend": lambda: comm.isend(stray, 0), "irecv": lambda: comm.irecv(stray, 0),
            "exchange": lambda: comm.exchange([(stray, 0)]),
            "post_unrecorded": lambda: comm.post_unrecorded([], [(stray, 0)])}
    with pytest.raises(ValueError, match=f"^{op} on dp: a tensor \\(2,\\) on meta, but this Comm expects cpu$"):
        call.get(op, lambda: getattr(comm, op)(stray))()
    assert comm.device == torch.device("cpu") and Comm().device == torch.device("cpu")
