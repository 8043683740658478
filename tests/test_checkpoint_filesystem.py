"""Checkpoints on a real cluster's filesystem, on two gloo ranks through `train(cfg)` (one launch for both):

- a rank slow to write and hash its checkpoint file (a slow shared filesystem) by more than --comm-timeout but less
  than --ckpt-timeout does not fail the job: the barriers around the files wait on the checkpoint group's timeout;
- an OUT that one rank cannot see (a node's local disk) is refused at the start, in one line naming the rank and
  its host, instead of failing at the first checkpoint.
"""

import datetime
import functools
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from minidist.comm.launch import run_ranks
from minidist.train import checkpoint, run_dir
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig, parse_config

COMM_TIMEOUT_S = 3
SLOW_S = 5  # more than COMM_TIMEOUT_S, less than the checkpoint's timeout
MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64, "max_seq_len": 16}


def config(out: Path, **changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=50_000, batch_size=4, seq_len=16, steps=2,
                    warmup_steps=1, eval_every=0, eval_batches=1, log_every=100, ckpt_every=2, out=str(out),
                    peak_flops=1e9, plot=False, comm_timeout=COMM_TIMEOUT_S, ckpt_timeout=60)
    return TrainConfig(**{**settings, **changes})


def _slow_hash(path, original):
    time.sleep(SLOW_S)
    return original(path)


def _rank_runs(root: str) -> dict:
    rank, results = dist.get_rank(), {}
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:  # this rank's filesystem does not show rank 0's files
            patch.setattr(run_dir, "_read_token", lambda path: None)
            patch.setattr(run_dir, "SHARED_WAIT_S", 0.0)
        try:
            train.train(config(Path(root) / "local"))
        except ConfigError as e:
            results["not_shared"] = str(e)
    # Under torchrun the world group's timeout is --comm-timeout (bootstrap creates it); run_ranks made it longer.
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=COMM_TIMEOUT_S), dist.group.WORLD)
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:  # writing and hashing this rank's file takes SLOW_S seconds
            patch.setattr(checkpoint, "sha256_file", functools.partial(_slow_hash, original=checkpoint.sha256_file))
        started = time.monotonic()
        summary = train.train(config(Path(root) / "slow"))
        results["slow"] = {"steps": summary["steps"], "seconds": time.monotonic() - started}
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=120), dist.group.WORLD)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_runs, 2, str(tmp_path_factory.mktemp("fs")), timeout=120, threads_per_rank=1)


def test_an_out_one_rank_cannot_see_is_refused_naming_it(results):
    for rank, result in enumerate(results):
        message = result["not_shared"]
        assert "\n" not in message
        blind = message.split(" cannot see ")[0]  # the ranks named: rank 1 alone
        assert blind.startswith("--out ") and blind.endswith(
            f"must be on a filesystem every node shares: rank 1 on host {socket.gethostname()}"), f"rank {rank}"


def test_a_slow_checkpoint_write_is_not_a_timeout(results, tmp_path_factory):
    for result in results:
        assert result["slow"]["steps"] == [0, 1]
        assert result["slow"]["seconds"] > SLOW_S  # the slow rank really held the others at the barrier
    root = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("fs*"))
    assert checkpoint.latest_step(root / "slow" / "checkpoints") == 2


def test_ckpt_timeout_is_checked_before_anything_starts():
    assert parse_config(["--ckpt-timeout", "90"]).ckpt_timeout == 90
    with pytest.raises(ConfigError, match="ckpt_timeout must be > 0 seconds, got 0"):
        parse_config(["--ckpt-timeout", "0"])
