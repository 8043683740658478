"""No silent hang: a rank that stops answering ends a torchrun job within --comm-timeout plus torchrun's teardown,
with one line naming the collective and its group, and leaves rank 0's flight record in OUT, whose diff names the
frozen rank. The stopped rank is frozen from outside (SIGSTOP, as a hung driver or a swapped-out host would), found
among torchrun's children by its RANK; the package has no hook for it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minidist.debug.diff import diff, load

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 10


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (torchrun starts its workers from a thread other than the main one)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "minidist.train",
           "--steps", "100000", "--log-every", "1000", "--eval-every", "0", "--ckpt-every", "0", "--batch-size", "4",
           "--seq-len", "16", "--max-bytes", "50000", "--set", "model.n_layers=1", "--set", "model.d_model=32",
           "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.d_ff=64", "--no-plot",
           "--peak-flops", "1e9", "--comm-timeout", str(TIMEOUT_S), "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    stopped = None
    try:
        for line in proc.stdout:  # wait for the first step: both ranks are inside the training loop
            if line.split("/")[0].split() == ["step", "1"]:  # "step   1/100000 | ..."
                break
        workers = [c for c in _children(proc.pid) if _rank_of(c) is not None]
        stopped = next(c for c in workers if _rank_of(c) == 1)
        os.kill(stopped, signal.SIGSTOP)
        frozen_at = time.monotonic()
        _, stderr = proc.communicate(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - frozen_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"exit {proc.returncode} {took:.1f} s after SIGSTOP")
    assert proc.returncode != 0
    assert took < TIMEOUT_S + 60
    lines = [line for line in stderr.splitlines() if line.startswith("error: rank 0:")]
    assert lines and "over group" in lines[0] and "failed" in lines[0], stderr[-2000:]
    # Rank 0 wrote its flight record on the way out; the frozen rank could not, and the diff names it.
    out = tmp_path / "run"
    record = json.loads((out / "flight" / "rank0.json").read_text())
    last = record["records"][-1]
    assert 1 in last["ranks"] and record["reason"].startswith("RuntimeError"), record["reason"]
    assert isinstance(record["started_at"], float)  # marked once the groups were up: tells jobs apart
    assert f"flight record in {out / 'flight' / 'rank0.json'}" in stderr
    findings = diff(load(out))
    assert [(f.kind, f.rank) for f in findings] == [("no-record", 1)], [f.message for f in findings]
    assert last["site"] in findings[0].message
