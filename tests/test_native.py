"""Chapter 18: minidist's pieces held against PyTorch's own, by the same numbers (minidist.native, and convert's
to-dcp / from-dcp). The rank grid as a DeviceMesh; placements as DTensors and a redistribute's bytes; ZeRO-3 as FSDP2;
tensor parallelism as parallelize_module; the pipeline schedules as torch.distributed.pipelining's; checkpoints as
DCP, resharded by DCP onto an FSDP2 model on another number of ranks and back. All multi-process cases run in one
launch per world size (tests/native_cases.py)."""

from __future__ import annotations

import atexit
import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import dp_cases
import native_cases
import parity
import pytest
import torch

from minidist.comm.topology import ParallelDims
from minidist.convert import dcp as dcp_convert
from minidist.convert import dcp_files, titan_model
from minidist.convert.hf_model import ConvertError
from minidist.convert.runs import finetune_toml, main
from minidist.debug import tolerance
from minidist.native import mesh, pipelining
from minidist.train import checkpoint, reshard
from minidist.train import loop as train
from minidist.train.config import parse_config


def _mean_losses(per_rank: list[list[float]]) -> list[float]:
    return [sum(r[i] for r in per_rank) / len(per_rank) for i in range(len(per_rank[0]))]


# --- the rank grid as a DeviceMesh ---------------------------------------------------------------------------------


def _seen_by(dims: ParallelDims, kind: str) -> ParallelDims:
    """What a mesh of `kind` says of `dims`: the grid knows no ep, the other two merge dp and cp."""
    if kind == "grid":
        return dataclasses.replace(dims, ep=1)
    return ParallelDims(dp=dims.dp * dims.cp, tp=dims.tp, pp=dims.pp, ep=dims.ep if kind == "experts" else 1)


def test_every_8_rank_layout_is_a_device_mesh_with_minidists_groups() -> None:
    """DeviceMesh's own code, each of 8 ranks played in this process on torch's fake backend: for every layout of 8
    ranks (each pp·dp·cp·tp = 8, each ep dividing dp·cp) the group and coordinate of every mesh dimension."""
    layouts = mesh.all_layouts(8)
    assert len(layouts) == 50 and ParallelDims(dp=2, tp=2, pp=2, ep=2) in layouts
    wrong = [w for dims in layouts for w in native_cases.fake_backend_mesh_mismatches(dims)]
    assert not wrong, "\n".join(wrong[:5])
    for dims in layouts:
        for kind, names in mesh.MESH_DIMS.items():
            assert mesh.dims_of_mesh(mesh.mesh_shape(dims, kind), names) == _seen_by(dims, kind), (dims, kind)


@pytest.mark.parametrize("world", [2, 4])
def test_device_mesh_groups_on_launched_ranks(world: int) -> None:
    for rank, result in enumerate(native_cases.results(world, *_dcp_args(world))):
        for case in result["mesh"]:
            for name, ours in case["ours"].items():
                assert ours == case["theirs"][name], (rank, case["dims"], case["kind"], name)
            assert case["back"] == _seen_by(case["dims"], case["kind"])


def test_a_mesh_that_is_not_minidists_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="not one of minidist's meshes"):
        mesh.dims_of_mesh((2, 2), ("dp", "sp"))
    with pytest.raises(ValueError, match="needs 2 names"):
        mesh.dims_of_mesh((2, 2), ("dp",))


# --- placements as DTensors; a redistribute as a collective ----------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_placements_are_dtensor_placements(world: int) -> None:
    """Every tp parameter's Placement as DTensor placements rebuilds the single-device tensor (`full_tensor`) and
    maps back to the same Split; a kv head copied on several tp ranks (2 kv heads, tp 4) is refused in one line."""
    for rank, result in enumerate(native_cases.results(world, *_dcp_args(world))):
        params = result["placement"]["params"]
        refused = sorted(n for n, p in params.items() if "refused" in p)
        kv = sorted(n for n in params if n.endswith(("attn.wk.weight", "attn.wv.weight")))
        assert refused == (kv if world == 4 else []), (rank, refused)
        for name, p in params.items():
            assert "refused" in p or (p["equal"] and p["back"]), (rank, name, p)
        assert params["blocks.0.attn.wq.weight"]["placements"] == ["S"]
        assert params["blocks.0.attn_norm.weight"]["placements"] == ["R"]


@pytest.mark.parametrize("world", [2, 4])
def test_redistribute_is_the_collective_and_bytes_of_chapter_00(world: int) -> None:
    """Each move runs the collective the table names (CommDebugMode's count), sends what the ledger's formula says
    (recorded from the collective's tensors), and minidist's Comm records the same bytes for the same move; gloo's
    Shard(0) -> Shard(1) is an all-gather of the whole tensor, where NCCL's all-to-all sends 1/p of it."""
    want_op = {"S0->R": "all_gather_into_tensor", "P->R": "all_reduce", "P->S0": "reduce_scatter_tensor",
               "S0->S1": "all_gather_into_tensor", "R->S0": None}
    x = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    total = sum(x + r for r in range(world))
    for rank, result in enumerate(native_cases.results(world, *_dcp_args(world))):
        for move, got in result["placement"]["moves"].items():
            assert got["counts"] == ({want_op[move]: 1} if want_op[move] else {}), (rank, move, got["counts"])
            assert got["recorded"] == got["formula"][1], (rank, move, got)
            assert got["ledger"] == got["nccl"][1], (rank, move, got)
        moves = result["placement"]["moves"]
        assert moves["S0->S1"]["recorded"] == 4 * 8 * 12 * (world - 1) // world
        assert moves["S0->S1"]["ledger"] == moves["S0->S1"]["recorded"] // world
        assert torch.equal(moves["P->R"]["value"], total) and torch.equal(moves["S0->R"]["value"], x + _own(x, world))


def _own(x: torch.Tensor, world: int) -> torch.Tensor:
    """Shard(0) -> Replicate of the shards each rank made from x + rank: row block r is x's plus r."""
    rows = x.shape[0] // world
    return torch.arange(world).repeat_interleave(rows)[:, None].float().expand_as(x)


# --- ZeRO-3 as FSDP2 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_zero3_and_one_device(world: int) -> None:
    """Three steps of the parity run (clipping active): FSDP2's losses, gradient norms and step-0 gradients equal
    the single-device run's and minidist's ZeRO-3's within fp32 tolerance; both keep 1/world of the parameters."""
    ref = parity.reference_run()
    per_rank = native_cases.results(world, *_dcp_args(world))
    fsdp = [r["fsdp"] for r in per_rank]
    zero3 = _mean_losses([f["zero3"]["losses"] for f in fsdp])
    parity.assert_losses_match(fsdp[0]["losses"], ref["losses"], f"FSDP2 dp{world}")
    parity.assert_losses_match(zero3, ref["losses"], f"ZeRO-3 dp{world}")
    assert tolerance.close(fsdp[0]["losses"], zero3), (fsdp[0]["losses"], zero3)
    parity.assert_norms_match(fsdp[0]["norms"], ref["grad_norms"], f"FSDP2 dp{world}")
    parity.assert_grads_match(fsdp[0]["grads"], ref["grads"], f"FSDP2 dp{world}")
    parity.assert_grads_match(fsdp[0]["zero3"]["grads"], ref["grads"], f"ZeRO-3 dp{world}")
    numel = sum(g.numel() for g in ref["grads"].values())
    for f in fsdp:
        ours, theirs = f["zero3"]["memory"]["params"], f["param_bytes"]
        assert 4 * numel / world <= min(ours, theirs) and max(ours, theirs) <= 4 * numel / world * 1.05, (ours, theirs)


@pytest.mark.parametrize("world", [2, 4])
def test_what_fsdp2_and_zero3_gather_ahead(world: int) -> None:
    """As each unit's forward starts (blocks 0..3, then the root: 4): minidist's ZeRO-3 has the next block's
    all-gather in flight; FSDP2 by default has only the root (nothing runs ahead on a CPU), and FSDP2 told to
    prefetch like ZeRO-3 (`prefetch_like_zero3`) holds exactly what ZeRO-3 holds."""
    f = native_cases.results(world, *_dcp_args(world))[0]["fsdp"]
    n = parity.CFG.n_layers
    assert f["zero3"]["gathered"] == [(n, [0])] + [(i, ([i + 1] if i + 1 < n else []) + [n]) for i in range(n)]
    assert f["gathered"] == [(n, [])] + [(i, [n]) for i in range(n)]
    assert f["gathered_with_prefetch"] == f["zero3"]["gathered"]


def test_fsdp2_mixed_precision_policy_matches_zero3_bf16_gathers() -> None:
    """bf16 autocast, bf16 parameter gathers, fp32 gradient reductions: minidist's `CommPrecision` on ZeRO-3 and its
    `MixedPrecisionPolicy` on FSDP2 train alike, within chapter 14's bf16 rule of each other and of the fp32 run
    (measured: 4e-4 relative between the two sides after 3 steps)."""
    got = native_cases.results(2, *_dcp_args(2))[0]["mixed"]
    ref = parity.reference_run()["losses"]
    assert tolerance.close(got["fsdp2"], got["zero3"], "bf16"), got
    assert tolerance.close(got["zero3"], ref, "bf16") and tolerance.close(got["fsdp2"], ref, "bf16"), (got, ref)
    assert got["zero3"] != ref and got["fsdp2"] != ref, "bf16 gathers must change the figures a little"


# --- TP as parallelize_module --------------------------------------------------------------------------------------


def test_parallelize_module_matches_minidist_tp() -> None:
    """Three AdamW steps of the parity model on one process and on tp2, tp2+sp, minidist's and DTensor's."""
    losses = native_cases.results(2, *_dcp_args(2))[0]["tp"]
    assert set(losses) == {"single", "minidist tp", "minidist tp+sp", "dtensor tp", "dtensor tp+sp"}
    for name, got in losses.items():
        assert tolerance.close(got, losses["single"]), (name, got, losses["single"])


# --- PP as torch.distributed.pipelining ----------------------------------------------------------------------------


def test_pipelining_schedules_match_minidists() -> None:
    """One step of each schedule on pp2, 4 micro-batches: the loss equals the single-device one on both sides and
    every gradient agrees; the action lists hold the same actions on each rank, in the same F/B order (torch's
    Schedule1F1B lists its last stage's forwards numbered from 1, a listing only: its executor is imperative)."""
    want = parity.reference_run()["losses"][0]
    for rank, result in enumerate(native_cases.results(2, *_dcp_args(2))):
        for schedule, r in result["pp"].items():
            assert tolerance.close([r["ours"], r["theirs"]], [want, want], steps=1), (rank, schedule, r)
            assert r["grads_equal"] and r["n_grads"] > 0, (rank, schedule)
            for p, (ours, theirs) in enumerate(zip(*r["actions"])):
                listing_quirk = schedule == "1f1b" and p == 1
                if not listing_quirk:
                    assert sorted(ours) == sorted(theirs), (schedule, p)
                fb = lambda names: [a for a in names if a[0] != "W"]  # noqa: E731
                if listing_quirk:
                    assert [a[0] for a in ours] == [a[0] for a in theirs]
                else:
                    assert fb(ours) == fb(theirs), (schedule, p, pipelining.first_difference(ours, theirs))
        for schedule in ("interleaved", "dualpipev"):  # identical, torch's whole backwards written as B then W
            assert all(a == b for a, b in zip(*result["pp"][schedule]["actions"])), schedule


# --- checkpoints as DCP ---------------------------------------------------------------------------------------------

_RUNS: dict[str, Path] = {}


def _runs() -> dict[str, Path]:
    """Once per session: a 6-step one-process run (the losses minidist logs), the same run stopped after step 2,
    and its checkpoint exported by to-dcp."""
    if not _RUNS:
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="minidist_dcp_"))
        atexit.register(shutil.rmtree, root, True)
        config = lambda out, **kw: dp_cases.trainer_config(str(out), log_every=1, microbatches=1, steps=6, **kw)  # noqa: E731
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train.train(config(root / "ref"))
            train.train(config(root / "part", stop_after=2))
        finally:
            torch.set_num_threads(threads)
        assert main(["to-dcp", str(root / "part"), str(root / "dcp")]) == 0
        _RUNS.update(root=root, ref=root / "ref", part=root / "part", dcp=root / "dcp", back=root / "dcp_back")
    return _RUNS


def _dcp_args(world: int) -> tuple[str, str]:
    """The launch's DCP arguments: world 2 continues the exported run under FSDP2 (the same launch's other cases)."""
    if world != 2:
        return "", ""
    runs = _runs()
    return str(runs["dcp"]), str(runs["back"])


def _losses(out: Path) -> list[float]:
    from trainer_parity import records

    return [r["loss"] for r in records(str(out))]


def test_to_dcp_from_dcp_round_trip_is_bit_for_bit(tmp_path: Path) -> None:
    """to-dcp then from-dcp: the weights, Adam's moments and step read back bit for bit (the q/k permutation is a
    gather), and the resumed run logs exactly the losses of the uninterrupted one."""
    runs = _runs()
    assert main(["from-dcp", str(runs["dcp"]), str(tmp_path / "back")]) == 0
    step = checkpoint.step_dir_name(2)
    for kind in ("value", "exp_avg", "exp_avg_sq"):
        a = reshard.read_full(runs["part"] / "checkpoints" / step, kind)
        b = reshard.read_full(tmp_path / "back" / "checkpoints" / step, kind)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = train.train(parse_config(["--config", str(tmp_path / "back" / dcp_convert.RUN_TOML), "--resume"]))
    finally:
        torch.set_num_threads(threads)
    assert again["resumed_from"] == 2 and again["losses"] == _losses(runs["ref"])[2:]


def test_dcp_reshards_onto_fsdp2_and_back(tmp_path: Path) -> None:
    """The one-process run's step-2 checkpoint, loaded by DCP onto an FSDP2 model on 2 ranks (in torchtitan's RoPE
    layout), trains steps 3-4 with the losses minidist logged; saved by DCP from those 2 ranks, from-dcp makes a
    run that one process resumes for steps 5-6, again with minidist's losses."""
    runs = _runs()
    ref = _losses(runs["ref"])
    got = native_cases.results(2, *_dcp_args(2))[0]["dcp"]
    assert got["start"] == 2 and tolerance.close(got["losses"], ref[2:4], steps=[3, 4]), (got, ref)
    assert main(["from-dcp", str(runs["back"]), str(tmp_path / "run")]) == 0
    again = train.train(parse_config(["--config", str(tmp_path / "run" / dcp_convert.RUN_TOML), "--resume"]))
    assert again["resumed_from"] == 4 and tolerance.close(again["losses"], ref[4:], steps=[5, 6]), (again, ref)


# --- hostile DCP input ----------------------------------------------------------------------------------------------


class _Touch:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _copy_dcp(tmp_path: Path) -> Path:
    target = tmp_path / "dcp"
    shutil.copytree(_runs()["dcp"], target)
    return target


def test_a_pickle_payload_in_metadata_is_refused_unrun(tmp_path: Path, capsys) -> None:
    dcp_dir = _copy_dcp(tmp_path)
    marker = tmp_path / "pwned"
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    assert main(["from-dcp", str(dcp_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "the payload ran"
    assert "posix.system" in err and "refused" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_payload_inside_real_metadata_and_a_path_out_of_the_directory_are_refused(tmp_path: Path) -> None:
    dcp_dir = _copy_dcp(tmp_path)
    metadata = dcp_files.read_metadata(dcp_dir)
    metadata.planner_data = _Touch(tmp_path / "pwned")  # a field DCP would hand back untouched
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConvertError, match="not DCP metadata"):
        dcp_files.read_metadata(dcp_dir)
    assert not (tmp_path / "pwned").exists()
    metadata.planner_data = None
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConvertError, match="not a file of"):
        dcp_files.read_metadata(dcp_dir)


def test_a_missing_or_mismatched_key_is_one_line(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    runs = _runs()
    state = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in
             dcp_files.tensor_shapes(dcp_files.read_metadata(runs["dcp"])).items()}
    key = dcp_convert.optimizer_key("layers.1.attention.qkv_linear.wk.weight", "exp_avg")
    changes = {"missing": lambda s: s.pop(key), "shape": lambda s: s.update({key: torch.zeros(3, 3)})}
    for name, change in changes.items():
        broken = dict(state)
        change(broken)
        out = tmp_path / name
        dcp.save(broken, storage_writer=dcp.FileSystemWriter(out))
        shutil.copy(runs["dcp"] / dcp_convert.RUN_FILE, out / dcp_convert.RUN_FILE)
        with pytest.raises(ConvertError, match=key.replace(".", r"\.")) as e:
            dcp_convert.from_dcp(out, tmp_path / f"run_{name}", finetune_toml)
        assert "\n" not in str(e.value)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    runs = _runs()
    assert main(["to-dcp", str(runs["part"]), str(runs["dcp"])]) == 2  # OUT holds a checkpoint: never replaced
    assert main(["to-dcp", str(runs["part"]), str(tmp_path / "x"), "--tp", "2"]) == 2
    assert main(["from-dcp", str(tmp_path), str(tmp_path / "y")]) == 2  # no .metadata
    with pytest.raises(SystemExit) as e:
        main(["to-dcp", str(runs["part"])])
    assert e.value.code == 2


def test_metadata_unpickler_reads_dcp_metadata() -> None:
    """What the unpickler admits is exactly what DCP writes: the exported checkpoint's metadata reads back whole."""
    metadata = dcp_files.read_metadata(_runs()["dcp"])
    shapes = dcp_files.tensor_shapes(metadata)
    assert shapes["layers.0.attention.qkv_linear.wq.weight"] == ((64, 64), torch.float32)
    assert shapes[dcp_convert.STEP_KEY] == ((), torch.int64)
    with pytest.raises(ConvertError, match="builtins.eval"):
        dcp_files.MetadataUnpickler(io.BytesIO(pickle.dumps(eval))).load()


# --- torchtitan's own Llama 3 -----------------------------------------------------------------------------------------


def test_torchtitan_llama3_computes_the_exported_logits() -> None:
    """torchtitan 0.3.0's Llama 3 (the `titan` extra; skipped without it), built with the run's shapes, loads the
    exported weights by name and computes the logits minidist computes (flex attention: forward only on a CPU)."""
    pytest.importorskip("torchtitan.models.llama3")
    import titan_reference

    runs = _runs()
    state = dcp_convert.read_dcp(runs["dcp"], titan_reference.model_config(runs["dcp"]))
    got, want = titan_reference.logits_both(runs["dcp"], state)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_titan_names_round_trip() -> None:
    names = [f"blocks.0.{k}" for k in titan_model.BLOCK] + list(titan_model.TOP)
    assert [titan_model.minidist_name(titan_model.titan_name(n)) for n in names] == names
    with pytest.raises(ConvertError, match="not a torchtitan"):
        titan_model.minidist_name("layers.0.attention.wqkv.weight")
