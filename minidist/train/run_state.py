"""A training run's state in a checkpoint, and how a run resumes from it.

A checkpoint after step s holds everything the next step depends on. Each rank file holds that rank's *pieces*
(minidist.train.reshard): the parts of the full model and optimizer state it is the first holder of, so a replica
writes no copy of what another rank writes, and its random generators; rank 0's also holds the run state that
does not depend on the layout: the learning-rate schedule, the sampler's position and the param groups' settings
(betas, eps, weight decay). Every resume loads through the pieces, in the layout that wrote the checkpoint as in
any other: the values copied are the saved numbers, so in the same layout step s+1 is bit for bit the step the
uninterrupted run took (tests/test_checkpoint.py checks it). The file format is minidist.train.checkpoint's.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import torch

from minidist.parallel.pp.schedules import V_SCHEDULES
from minidist.train import checkpoint, optim, reshard
from minidist.train.config import TrainConfig, config_to_values
from minidist.train.run import Run
from minidist.trust import replicas

# Settings a resumed run must share with the checkpoint (the rest, e.g. --eval-every or --dtype, may change).
SAME_RUN_KEYS = ("model", "data", "max_bytes", "val_fraction", "batch_size", "seq_len", "seed")


def save_run(run: Run, steps_done: int) -> None:
    """Checkpoint after `steps_done` optimizer steps: this rank's pieces and generators (rank 0: the run state too),
    plus meta.json from rank 0. The replicas are compared first: a checkpoint must never preserve copies that
    disagree (the first holder's would be kept, silently)."""
    replicas.check_model(run.parallel, f"check before the checkpoint at step {steps_done}")
    pieces, index = reshard.pieces_to_save(run.parallel, run.topo)
    state = {"rng": rng_state(run.device), "pieces": pieces}
    if run.env.rank == 0:
        state["run"] = {"schedule": run.schedule.state_dict(), "sampler": run.sampler.state_dict(),
                        "param_groups": optim.group_settings(run.parallel.optimizer)}
    meta = {"config": config_to_values(run.cfg), "parallel": dataclasses.asdict(run.topo.dims),
            "data": run.info["data_identity"]}
    checkpoint.save_checkpoint(run.out / "checkpoints", steps_done, state, meta, rank=run.env.rank,
                               world_size=run.env.world_size, barrier=run.barrier, pieces=index)
    if run.is_main:  # after the final barrier: no rank still reads or writes an older checkpoint
        checkpoint.prune_checkpoints(run.out / "checkpoints", keep=run.cfg.keep)
    if run.barrier is not None:  # the others wait for the deletion here, not in the next step's collectives
        run.barrier()


def end_step(cfg: TrainConfig) -> int:
    """The step index the loop stops before: --steps, or --stop-after N (N completed steps; the LR schedule and the
    checkpoint cadence stay those of --steps, so a resumed run continues the same curve)."""
    return cfg.stop_after if cfg.stop_after > 0 else cfg.steps


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether step index `step` ends with a checkpoint: every --ckpt-every steps and at the last step, and always at
    --stop-after (a time-limited job must leave a checkpoint to continue from)."""
    due = cfg.ckpt_every > 0 and (step == cfg.steps - 1 or (step + 1) % cfg.ckpt_every == 0)
    return due or step + 1 == cfg.stop_after


def checkpoint_if_due(run: Run, step: int) -> None:
    """After step index `step`: checkpoint if `checkpoint_due`."""
    cfg = run.cfg
    stopping = step + 1 == cfg.stop_after
    if checkpoint_due(cfg, step):
        save_run(run, step + 1)
    if stopping and cfg.stop_after < cfg.steps:
        run.log(f"--stop-after {cfg.stop_after}: stopped with a checkpoint at step {step + 1} of {cfg.steps}; "
                "continue with --resume")


def restore_run(run: Run) -> int | None:
    """With --resume, load the latest checkpoint in OUT and return its step (None: none there, start at 0).
    Deletes nothing: a fresh run reaches here only into an OUT without a run (minidist.train.run_dir checks it).
    A damaged checkpoint or a mismatch is a one-line ValueError naming the file or what differs."""
    root = run.out / "checkpoints"
    step = checkpoint.latest_step(root) if run.cfg.resume else None
    if step is None:
        return None
    if 0 < run.cfg.stop_after <= step:
        raise ValueError(f"the checkpoint is at step {step}, already at or past --stop-after {run.cfg.stop_after}")
    meta = checkpoint.load_meta(root, step)
    saved = meta.get("config")
    saved = saved if isinstance(saved, dict) else {}
    if _both_datasets(meta.get("data"), run.info["data_identity"]):  # moved (e.g. to a node's local disk): the
        saved = {**saved, "data": run.cfg.data}  # manifest's SHA-256 identifies a dataset, wherever it lies
    check_same_run(saved, config_to_values(run.cfg))
    check_same_data(meta.get("data"), run.info["data_identity"])
    same = same_layout(meta, run)
    changed = restore_pieces(run, checkpoint_dir(root, step), meta, same)
    if run.barrier is not None:  # every rank has read its pieces (--ckpt-timeout) before the check's collectives
        run.barrier()
    if changed:
        run.log(f"the checkpoint's optimizer settings are kept: {', '.join(changed)} (not this run's)")
    # Copies that differ now come from the index (a piece that fills one replica and not another), not the files.
    where = "" if same else " in another layout"
    replicas.check_model(run.parallel, f"check after resuming from step {step}{where}")
    return step


def same_layout(meta: dict, run: Run) -> bool:
    """Whether the checkpoint's rank files are this run's ranks' own (then each rank restores its own generators)."""
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    return (meta.get("world_size") == run.env.world_size and meta.get("parallel") == dataclasses.asdict(run.topo.dims)
            and all(saved.get(k) == getattr(run.cfg, k) for k in ("zero", "virtual_stages"))
            # zbv places its chunks in a V: the same dims and v hold other layers on each rank than a loop does
            and (saved.get("schedule") in V_SCHEDULES) == (run.cfg.schedule in V_SCHEDULES))


def restore_pieces(run: Run, step_dir: Path, meta: dict, same: bool) -> list[str]:
    """Each rank fills what it holds from the pieces that intersect it (minidist.train.reshard), whichever layout wrote
    them; the run state comes from rank 0's file, the random generators from the rank's own file in the same
    layout, else from rank 0's. Returns the optimizer settings the checkpoint changed (`optim.load_group_settings`)."""
    reader = reshard.PieceReader(step_dir, meta)
    first = reader.open(checkpoint.rank_file(0))
    own = reader.open(checkpoint.rank_file(run.env.rank)) if same else first
    try:  # plain data by now (weights_only), but not necessarily the shape this run expects
        state = first["run"]
        run.schedule.load_state_dict(state["schedule"])
        run.sampler.load_state_dict(state["sampler"])
        changed = optim.load_group_settings(run.parallel.optimizer, state["param_groups"])
        reshard.load_pieces(run.parallel, run.topo, reader)
        set_rng_state(own["rng"], run.device)
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:
        lines = str(e).splitlines() or [""]
        where = "" if same else " in its new layout"
        raise ValueError(f"{step_dir} does not fit this run{where}: {type(e).__name__} {lines[0]}") from None
    return changed


def check_same_run(saved: dict, now: dict) -> None:
    diffs = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in SAME_RUN_KEYS if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"settings differ from the checkpoint's: {'; '.join(diffs)}")


def _both_datasets(saved: object, now: dict) -> bool:
    return isinstance(saved, dict) and saved.get("manifest_sha256") is not None and now["manifest_sha256"] is not None


def check_same_data(saved: object, now: dict) -> None:
    """The dataset (its manifest's SHA-256, which covers every shard's) and the tokenizer the checkpoint was trained
    on. A checkpoint from before they were recorded trained on a text source with the byte tokenizer."""
    if saved is None:
        saved = {"manifest_sha256": None, "tokenizer_sha256": now["tokenizer_sha256"] if now["manifest_sha256"] is None
                 else "(not recorded: the byte tokenizer)"}
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint's data record is {type(saved).__name__}, not a table")
    what = {"manifest_sha256": "dataset (manifest SHA-256)", "tokenizer_sha256": "tokenizer (SHA-256)"}
    diffs = [f"{what[k]} {str(saved.get(k))[:12]} -> {str(now[k])[:12]}" for k in what if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"the data differs from the checkpoint's: {'; '.join(diffs)}; resume with the data it was "
                         "trained on")


def rng_state(device: torch.device, cuda: Any = torch.cuda) -> dict:
    """This rank's generators: Python's, the CPU's and, on CUDA, its own GPU's only (`cuda`: torch.cuda, or a
    stand-in for a test). Not every visible GPU's: reading them makes a CUDA context on each, and a node that
    shows fewer GPUs on resume could not take them back."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": [cuda.get_rng_state(device)] if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device, cuda: Any = torch.cuda) -> None:
    """Put back what `rng_state` saved; the CUDA state goes to this rank's device, whichever index it has now. A
    checkpoint written before holds every visible GPU's state: this rank's device's is taken from it (by index)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    saved = state["cuda"]
    if device.type == "cuda" and saved:
        index = device.index if device.index is not None else cuda.current_device()
        cuda.set_rng_state(saved[0] if len(saved) == 1 else saved[index], device)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / checkpoint.step_dir_name(step)
