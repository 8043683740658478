"""A training run's state in a checkpoint, and how a run resumes from it.

A checkpoint after step s holds everything the next step depends on: this rank's model and optimizer state, the
learning-rate schedule, the sampler's position and the random generators. Restored, step s+1 is bit for bit the
step the uninterrupted run took (tests/test_checkpoint.py checks it). The file format is minidist.checkpoint's.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import torch

from minidist import checkpoint, replicas, reshard
from minidist.distributed import barrier_for
from minidist.train_config import config_to_values

# Settings a resumed run must share with the checkpoint (the rest, e.g. --eval-every or --dtype, may change).
SAME_RUN_KEYS = ("model", "data", "max_bytes", "val_fraction", "batch_size", "seq_len", "seed")


def save_run(run: Any, steps_done: int) -> None:
    """Checkpoint after `steps_done` optimizer steps: this rank's state, plus meta.json from rank 0. The replicas
    are compared first: a checkpoint must never preserve copies that disagree."""
    replicas.check_run(run, f"check before the checkpoint at step {steps_done}")
    pieces, index = reshard.pieces_to_save(run.parallel, run.topo)  # what another layout reads
    state = {**run.parallel.state_dict(), "schedule": run.schedule.state_dict(),
             "sampler": run.sampler.state_dict(), "rng": rng_state(), "pieces": pieces}
    meta = {"config": config_to_values(run.cfg), "parallel": dataclasses.asdict(run.topo.dims)}
    barrier = barrier_for(run.device) if run.env.world_size > 1 else None
    checkpoint.save_checkpoint(run.out / "checkpoints", steps_done, state, meta, rank=run.env.rank,
                               world_size=run.env.world_size, barrier=barrier, pieces=index)
    if run.is_main:  # after the final barrier: no rank still reads or writes an older checkpoint
        checkpoint.prune_checkpoints(run.out / "checkpoints", keep=run.cfg.keep)


def end_step(cfg: Any) -> int:
    """The step index the loop stops before: --steps, or --stop-after N (N completed steps; the LR schedule and the
    checkpoint cadence stay those of --steps, so a resumed run continues the same curve)."""
    return cfg.stop_after if cfg.stop_after > 0 else cfg.steps


def checkpoint_if_due(run: Any, step: int) -> None:
    """After step index `step`: checkpoint every --ckpt-every steps and at the last step, and always at --stop-after
    (a time-limited job must leave a checkpoint to continue from)."""
    cfg = run.cfg
    due = cfg.ckpt_every > 0 and (step == cfg.steps - 1 or (step + 1) % cfg.ckpt_every == 0)
    stopping = step + 1 == cfg.stop_after
    if due or stopping:
        save_run(run, step + 1)
    if stopping and cfg.stop_after < cfg.steps:
        run.log(f"--stop-after {cfg.stop_after}: stopped with a checkpoint at step {step + 1} of {cfg.steps}; "
                "continue with --resume")


def restore_run(run: Any) -> int | None:
    """With --resume, load the latest checkpoint in OUT and return its step (None: none there, start at 0).
    Deletes nothing: a fresh run reaches here only into an OUT without a run (minidist.run_dir checks it).
    A damaged checkpoint or a mismatch is a one-line ValueError naming the file or what differs."""
    root = run.out / "checkpoints"
    step = checkpoint.latest_step(root) if run.cfg.resume else None
    if step is None:
        return None
    if 0 < run.cfg.stop_after <= step:
        raise ValueError(f"the checkpoint is at step {step}, already at or past --stop-after {run.cfg.stop_after}")
    meta = checkpoint.load_meta(root, step)
    saved = meta.get("config")
    check_same_run(saved if isinstance(saved, dict) else {}, config_to_values(run.cfg))
    if not same_layout(meta, run):
        restore_resharded(run, checkpoint_dir(root, step), meta)
        replicas.check_run(run, f"check after resuming from step {step} in another layout")
        return step
    state, meta = checkpoint.load_checkpoint(root, step, rank=run.env.rank, world_size=run.env.world_size)
    try:  # plain data by now, but not necessarily the shape this run expects
        run.schedule.load_state_dict(state["schedule"])
        run.sampler.load_state_dict(state["sampler"])
        run.parallel.load_state_dict(state)
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        lines = str(e).splitlines() or [""]
        path = checkpoint_dir(root, step) / checkpoint.rank_file(run.env.rank)
        raise ValueError(f"{path} does not fit this run: {type(e).__name__} {lines[0]}") from None
    replicas.check_run(run, f"check after resuming from step {step}")  # rank files that disagree, loaded unevenly
    return step


def same_layout(meta: dict, run: Any) -> bool:
    """Whether the checkpoint's rank files are this run's ranks' own (then they are loaded as they are)."""
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    return (meta.get("world_size") == run.env.world_size and meta.get("parallel") == dataclasses.asdict(run.topo.dims)
            and all(saved.get(k) == getattr(run.cfg, k) for k in ("zero", "virtual_stages")))


def restore_resharded(run: Any, step_dir: Path, meta: dict) -> None:
    """Another layout wrote the checkpoint: each rank fills what it holds now from the pieces that intersect it
    (minidist.reshard); the layout-free state (schedule, sampler, random generators) comes from rank 0's file."""
    reader = reshard.PieceReader(step_dir, meta)
    first = reader.open(checkpoint.rank_file(0))
    try:
        run.schedule.load_state_dict(first["schedule"])
        run.sampler.load_state_dict(first["sampler"])
        reshard.load_pieces(run.parallel, run.topo, reader)
        set_rng_state(first["rng"])
    except (KeyError, TypeError, RuntimeError) as e:
        lines = str(e).splitlines() or [""]
        raise ValueError(f"{step_dir} does not fit this run in its new layout: {type(e).__name__} {lines[0]}"
                         ) from None


def check_same_run(saved: dict, now: dict) -> None:
    diffs = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in SAME_RUN_KEYS if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"settings differ from the checkpoint's: {'; '.join(diffs)}")


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / checkpoint.step_dir_name(step)
