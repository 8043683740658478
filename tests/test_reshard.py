"""Resharded resume (minidist.train.reshard): the run arithmetic on its own, then trainer runs stopped with
--stop-after in one layout and resumed in another, whose logs must be the uninterrupted one-process run's (rel 1e-5),
and whose checkpoints, read back whole by `read_full_model`, must be the one-process run's at the same step.

Chains of 6 steps (each arrow a --stop-after checkpoint, then --resume in the next layout):

    A    dp2 --2--> tp2 --4--> pp2
    B    pp2 x 2 virtual stages --2--> dp2 ZeRO-1 --4--> 1 process
    C    1 process --2--> dp2 ZeRO-3 --4--> cp2 --5--> 1 process
    MoE  dp2 ep2 ZeRO-2 --3--> 1 process          (the router biases are buffers, resumed by name)

One launch of 2 ranks runs every multi-process segment; the one-process segments run here."""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import trainer_parity

from minidist.comm.bootstrap import DistEnv, init_distributed
from minidist.comm.launch import run_ranks
from minidist.train import checkpoint, reshard, run_state
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.preflight import resolve_layout

# tied embeddings: under pp the first and last stage each hold tok_emb.weight, and only one of them writes it
MODEL = {"n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 32,
         "tie_embeddings": True}
MOE = {**MODEL, "moe": {"n_experts": 4, "top_k": 2, "d_expert": 32, "bias_update_speed": 0.01}}


def config(out: str, **changes) -> TrainConfig:
    """6 steps of batch 4 x 16 with clipping active, evaluations after steps 3 and 6, no periodic checkpoints."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=50_000, batch_size=4, seq_len=16,
                    microbatches=2, steps=6, warmup_steps=1, grad_clip=1.0, eval_every=3, eval_batches=1,
                    log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False, check_every=0)
    return TrainConfig(**{**settings, **changes})


# chain: [(layout or None for one process, stop after), ...]; the last segment runs to the end
CHAINS = {
    "A": [(dict(dp=2), 2), (dict(tp=2), 4), (dict(pp=2), 0)],
    "B": [(dict(pp=2, virtual_stages=2, schedule="interleaved"), 2), (dict(dp=2, zero=1), 4), (None, 0)],
    "C": [(None, 2), (dict(dp=2, zero=3), 4), (dict(cp=2), 5), (None, 0)],
    "MoE": [(dict(dp=2, ep=2, zero=2, model_overrides=MOE), 3), (dict(model_overrides=MOE), 0)],
}


def segment_config(root: str, chain: str, i: int) -> TrainConfig:
    layout, stop = CHAINS[chain][i]
    return config(str(Path(root) / chain), stop_after=stop, resume=i > 0, **(layout or {}))


def is_multi(layout: dict | None) -> bool:
    return layout is not None and any(layout.get(k, 1) > 1 for k in ("dp", "tp", "pp", "cp", "ep"))


# A checkpoint loaded in another layout and saved again at once: (chain, step, name, layout). The written pieces
# differ (other files, other runs); read whole they must be the same bits: values and optimizer state.
RESAVES = [("A", 4, "tp2 to pp2 interleaved", dict(pp=2, virtual_stages=2, schedule="interleaved")),
           ("A", 4, "tp2 to dp2 zero3", dict(dp=2, zero=3)),
           ("B", 4, "dp2 zero1 to tp2", dict(tp=2)),
           ("MoE", 3, "dp2 ep2 zero2 to dp2 ep2", dict(dp=2, ep=2, model_overrides=MOE)),
           ("MoE", 3, "dp2 ep2 zero2 to 1 process", dict(model_overrides=MOE))]


def _rank_segments(root: str) -> None:
    """Every multi-process segment of every chain, in order (each chain's are consecutive); the resaves."""
    for chain, segments in CHAINS.items():
        for i, (layout, _) in enumerate(segments):
            if is_multi(layout):
                train.train(segment_config(root, chain, i))
                dist.barrier()
    for chain, step, name, layout in RESAVES:
        if is_multi(layout):
            resave(root, chain, step, name, layout)


def resave(root: str, chain: str, step: int, name: str, layout: dict) -> None:
    """Load `chain`'s checkpoint at `step` in `layout` (as --resume does) and save it again, under resave/NAME."""
    src = Path(root) / chain / "checkpoints" / checkpoint.step_dir_name(step)
    out = Path(root) / "resave" / name
    env = DistEnv.detect()
    if env.rank == 0:
        shutil.copytree(src, out / "checkpoints" / src.name)
        (out / "checkpoints" / checkpoint.LATEST).write_text(src.name + "\n")
    if env.world_size > 1:
        dist.barrier()
    cfg = config(str(out), resume=True, **layout)
    device = torch.device("cpu")
    layout = resolve_layout(cfg, env.world_size)
    topo, _ = init_distributed(layout.dims, env, device, timeout_s=120)
    run = train.setup(cfg, layout, env, topo, device)
    assert run_state.restore_run(run) == step
    run_state.save_run(run, step)


def _one_process(root: str, chain: str, i: int) -> None:
    trainer_parity.single_process_records(str(Path(root) / chain), lambda out: segment_config(root, chain, i))


def _chains(root: str) -> str:
    """Each chain's one-process segments before its multi-process ones, one launch for those, then the rest."""
    first = {c: min(i for i, (layout, _) in enumerate(s) if is_multi(layout)) for c, s in CHAINS.items()}
    for chain in CHAINS:
        for i in range(first[chain]):
            _one_process(root, chain, i)
    run_ranks(_rank_segments, 2, root, timeout=600, threads_per_rank=1)
    for chain, segments in CHAINS.items():
        for i, (layout, _) in enumerate(segments):
            if i > first[chain] and not is_multi(layout):
                _one_process(root, chain, i)
    for chain, step, name, layout in RESAVES:
        if not is_multi(layout):
            resave(root, chain, step, name, layout)
    return root


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> str:
    return _chains(str(tmp_path_factory.mktemp("chains")))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, str]:
    """The uninterrupted one-process runs (dense and MoE), with a checkpoint every step."""
    outs = {}
    for name, model in (("dense", MODEL), ("MoE", MOE)):
        out = str(tmp_path_factory.mktemp(name))
        trainer_parity.single_process_records(out, functools.partial(config, model_overrides=model, ckpt_every=1,
                                                                      keep=6))
        outs[name] = out
    return outs


@pytest.mark.parametrize("chain", list(CHAINS))
def test_resume_in_another_layout_logs_the_one_process_run(chains, references, chain) -> None:
    out = Path(chains) / chain
    reference = references["MoE" if chain == "MoE" else "dense"]
    trainer_parity.assert_logs_match(chain, trainer_parity.records(str(out)), trainer_parity.records(reference))
    steps = checkpoint.complete_steps(out / "checkpoints")
    assert steps == [stop for _, stop in CHAINS[chain] if stop]  # --stop-after left its checkpoint, nothing else


@pytest.mark.parametrize("chain, step, name", [r[:3] for r in RESAVES], ids=[r[2] for r in RESAVES])
def test_resharded_load_keeps_every_bit(chains, chain, step, name) -> None:
    step_dir = checkpoint.step_dir_name(step)
    written = Path(chains) / chain / "checkpoints" / step_dir
    again = Path(chains) / "resave" / name / "checkpoints" / step_dir
    for kind in ("value", "exp_avg", "exp_avg_sq"):
        want, got = reshard.read_full(written, kind), reshard.read_full(again, kind)
        assert sorted(got) == sorted(want) and want
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {kind} of {key}"
    if chain == "MoE":
        values = reshard.read_full_model(written)  # the router biases are there (and compared above), not zero
        assert any(k.endswith("router_bias") and v.abs().sum() > 0 for k, v in values.items())


def test_one_writer_per_piece(chains) -> None:
    """Replicas do not write their copies: a dp2 checkpoint holds each element once (read_full_model checks it),
    in the file of dp rank 0; ZeRO-3's slices are written by both ranks."""
    for chain, step, writers in (("A", 2, {"rank0.pt"}), ("C", 4, {"rank0.pt", "rank1.pt"})):
        meta = json.loads((Path(chains) / chain / "checkpoints" / checkpoint.step_dir_name(step) / "meta.json")
                          .read_text())
        assert {p["file"] for p in meta["pieces"]} == writers
        names = [p["name"] for p in meta["pieces"] if p["file"] == "rank0.pt"]
        assert len(names) == len(set(names))


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return [t for item in items for t in _tensors(item)]


def test_replicas_write_no_bytes(chains) -> None:
    """One writer per piece, in bytes: the rank 1 file of a dp2 (ZeRO-0) checkpoint holds no parameter or optimizer
    state (rank 0 is the first holder of everything), and a dp2, a dp2 ZeRO-1 and a tp2 checkpoint each weigh what
    the one-process checkpoint of the same model does, within 10% (index records, each rank's random generators)."""
    def step_dir(chain: str, step: int) -> Path:
        return Path(chains) / chain / "checkpoints" / checkpoint.step_dir_name(step)

    def total(path: Path) -> int:
        return sum(p.stat().st_size for p in path.glob("rank*.pt"))

    one = total(step_dir("C", 2))  # one process, after 2 steps (every optimizer state exists)
    rank1 = torch.load(step_dir("A", 2) / "rank1.pt", weights_only=True)
    assert rank1["pieces"] == [] and "run" not in rank1
    assert not [t for t in _tensors(rank1) if t.is_floating_point()]  # its generators' bytes only
    for name, path in (("dp2", step_dir("A", 2)), ("dp2 ZeRO-1", step_dir("B", 4)), ("tp2", step_dir("A", 4))):
        assert total(path) <= 1.1 * one, f"{name}: {total(path)} bytes, one process {one}"


def test_runs_of_blocks_and_zero_ranges() -> None:
    full = torch.arange(4 * 6 * 2).reshape(4, 6, 2)
    for offsets, shape in (((0, 0, 0), (4, 6, 2)), ((2, 0, 0), (2, 6, 2)), ((0, 3, 0), (4, 3, 2)),
                           ((0, 0, 1), (4, 6, 1)), ((1, 2, 0), (2, 2, 2))):
        block = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
        runs = reshard.block_runs(full.shape, offsets, shape)
        assert torch.equal(torch.cat([torch.arange(s, s + n) for s, n in runs.tolist()]), block.reshape(-1))
        assert torch.equal(reshard.expand(reshard.compress(runs)), runs)
        assert len(reshard.compress(runs)) <= 2  # groups grow with levels, not rows
        for start, stop in ((0, block.numel()), (1, 5), (3, block.numel() - 2), (7, 8)):  # ZeRO ranges
            sub = reshard.sub_runs(runs, start, stop)
            assert torch.equal(torch.cat([torch.arange(s, s + n) for s, n in sub.tolist()]),
                               block.reshape(-1)[start:stop])


def test_copy_runs_fills_the_intersection() -> None:
    full = torch.arange(48.0)
    dst_runs = reshard.block_runs((8, 6), (0, 3), (8, 3))  # last-dim split: one run per row
    src_runs = reshard.sub_runs(reshard.block_runs((8, 6), (2, 0), (6, 6)), 5, 30)  # a ZeRO range of a dim-0 block
    src = torch.cat([full[s:s + n] for s, n in src_runs.tolist()])
    dst = torch.full((24,), -1.0)
    copied = reshard.copy_runs(dst, dst_runs, src, src_runs)
    want = full.reshape(8, 6)[:, 3:].reshape(-1)
    held = {i for s, n in src_runs.tolist() for i in range(s, s + n)}
    mask = torch.tensor([int(v) in held for v in want])
    assert copied == int(mask.sum()) > 0
    assert torch.equal(dst[mask], want[mask]) and (dst[~mask] == -1).all()


def test_missing_elements_and_bad_stop_after_are_one_line(chains, tmp_path) -> None:
    step_dir = Path(chains) / "A" / "checkpoints" / checkpoint.step_dir_name(2)
    meta = json.loads((step_dir / "meta.json").read_text())
    reader = reshard.PieceReader(step_dir, {**meta, "pieces": meta["pieces"][1:]})  # the first piece lost
    with pytest.raises(ValueError, match=f"holds no {meta['pieces'][0]['name']}"):
        reader.fill(meta["pieces"][0]["name"], (1,), torch.tensor([[0, 1]]), torch.zeros(1))
    with pytest.raises(ValueError, match="not sorted, disjoint"):
        reshard.PieceReader(step_dir, {**meta, "pieces": [{**meta["pieces"][0], "runs": [[5, 3, 1, 0],
                                                                                         [0, 3, 1, 0]]}]})
    assert train.parse_config(["--stop-after", "3", "--steps", "6"]).stop_after == 3
    with pytest.raises(ValueError, match="more runs than"):  # refused before 10^12 runs are expanded
        reshard.PieceReader(step_dir, {**meta, "pieces": [{**meta["pieces"][0], "runs": [[0, 1, 10**12, 1]]}]})
    with pytest.raises(ConfigError, match="stop-after 7 is outside"):
        train.train(config(str(tmp_path / "x"), stop_after=7))
    with pytest.raises(ConfigError, match="already at or past --stop-after 2"):
        train.train(config(str(Path(chains) / "A"), stop_after=2, resume=True, dp=1))


def test_the_stopping_step_prints_its_progress_line(tmp_path, capsys) -> None:
    """--stop-after 2 of 6 steps (evaluations every 3, progress lines every 100): the stopping step prints its
    progress line, but is not evaluated (evaluations keep the cadence of --steps, so that a stopped and resumed run
    logs exactly what a straight run does: see test_resume_in_another_layout_logs_the_one_process_run)."""
    summary = train.train(config(str(tmp_path / "stop"), stop_after=2, check_every=100))
    assert summary["steps"] == [0, 1]
    assert summary["val_losses"] == {}, summary["val_losses"]
    printed = capsys.readouterr().out
    assert any(line.startswith("step 2/6 |") for line in printed.splitlines()), printed[-2000:]
