"""The flight recorder (minidist.comm.recorder) and its diff (minidist.debug.diff): ring bounds, record fields and
indices, what a Comm records, the trainer's hook (exception, SIGUSR1, SIGTERM), and the diff of hand-made records
for each kind of divergence."""

import json
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm
from minidist.comm.launch import RankFailed, run_ranks
from minidist.comm.recorder import FORMAT, FlightRecorder, flight_path, recording
from minidist.debug.__main__ import main as debug_main
from minidist.debug.diff import FlightError, diff, load, report
from minidist.train.config import ConfigError

HERE = "tests/test_flight_recorder.py"


def _line_of(marker: str) -> int:
    """The line of this file holding `marker` in a comment (so the tests know the call sites to expect)."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


# ---------------------------------------------------------------------------------------------------------------
# The recorder
# ---------------------------------------------------------------------------------------------------------------


def _record_some(recorder: FlightRecorder) -> None:
    recorder.record("dp", (0, 1), "all_reduce", (4,), torch.float32, detail="sum")  # site-a
    recorder.record("dp", (0, 1), "send", (2, 3), torch.bfloat16, peer=1)
    recorder.record("dp", (0, 1), "send", (2, 3), torch.bfloat16, peer=1)
    recorder.record("dp", (0, 1), "recv", (2, 3), torch.bfloat16, peer=1)
    recorder.record("tp", (0, 2), "all_reduce", (4,), torch.float32)
    recorder.record("dp", (0, 1), "broadcast", (5,), torch.int64, detail="src=0")


def test_records_fields_indices_and_site():
    recorder = FlightRecorder(rank=0)
    _record_some(recorder)
    records = recorder.records()
    assert [r["seq"] for r in records] == list(range(6))
    # Collectives count per group; sends per (group, destination); receives per (group, source).
    assert [(r["group"], r["op"], r["index"]) for r in records] == [
        ("dp", "all_reduce", 0), ("dp", "send", 0), ("dp", "send", 1), ("dp", "recv", 0), ("tp", "all_reduce", 0),
        ("dp", "broadcast", 1)]
    first = records[0]
    assert first == {"seq": 0, "group": "dp", "ranks": [0, 1], "op": "all_reduce", "index": 0, "shape": [4],
                     "dtype": "float32", "peer": None, "batch": None, "detail": "sum",
                     "site": f"{HERE}:{_line_of('site-a')} in _record_some"}
    assert records[1]["dtype"] == "bfloat16" and records[1]["peer"] == 1
    json.dumps(recorder.snapshot("test"))  # plain JSON, nothing else


def test_ring_keeps_the_last_calls_and_counts_the_dropped(tmp_path):
    recorder = FlightRecorder(rank=3, capacity=4)
    for _ in range(10):
        recorder.record("dp", (2, 3), "all_reduce", (1,), torch.float32)
    assert len(recorder) == 4 and recorder.seq == 10
    records = recorder.records()
    assert [r["seq"] for r in records] == [6, 7, 8, 9]
    assert [r["index"] for r in records] == [6, 7, 8, 9]  # indices go on counting past the dropped calls
    dump = json.loads(recorder.write(tmp_path / "r.json", "because").read_text())
    assert (dump["format"], dump["rank"], dump["reason"], dump["capacity"], dump["dropped"]) == (
        FORMAT, 3, "because", 4, 6)
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(0, capacity=0)


def test_recording_is_cheap():
    recorder = FlightRecorder(rank=0)
    shape = (4,)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(20000):
            recorder.record("dp", (0, 1), "all_reduce", shape, torch.float32, None, None, "sum")
        best = min(best, (time.perf_counter() - started) / 20000)
    print(f"{best * 1e6:.2f} us per recorded call")
    assert best < 50e-6  # ~2 µs measured; a gloo collective costs tens of µs, NCCL's launch a few


def comm_records() -> list[dict]:
    """Rank function: a few calls through a Comm with a recorder; returns the records."""
    rank = dist.get_rank()
    recorder = FlightRecorder(rank)
    comm = Comm(name="dp", recorder=recorder)
    comm.all_reduce(torch.ones(3), op="max")  # comm-a
    comm.all_gather(torch.ones(2, 2))
    comm.broadcast(torch.ones(1), src=1)
    for handle in comm.exchange(sends=[(torch.ones(4), 1 - rank)], recvs=[(torch.empty(4), 1 - rank)]):  # comm-x
        handle.wait()
    out = torch.empty(5, dtype=torch.float64)
    if rank == 0:
        comm.send(torch.ones(5, dtype=torch.float64), 1)
    else:
        comm.recv(out, 0)
    comm.barrier()
    Comm(dist.new_group([rank]), name="solo", recorder=recorder).all_reduce(torch.ones(1))  # a group of one
    return recorder.records()


def test_comm_records_every_call_with_its_caller():
    per_rank = run_ranks(comm_records, 2, timeout=30, threads_per_rank=1)
    for rank, records in enumerate(per_rank):
        ops = [(r["op"], r["shape"], r["dtype"], r["peer"], r["detail"]) for r in records]
        other = 1 - rank
        p2p = [("send", [5], "float64", 1, None)] if rank == 0 else [("recv", [5], "float64", 0, None)]
        assert ops == [("all_reduce", [3], "float32", None, "max"), ("all_gather", [2, 2], "float32", None, None),
                       ("broadcast", [1], "float32", None, "src=1"), ("recv", [4], "float32", other, None),
                       ("send", [4], "float32", other, None), *p2p, ("barrier", [], "None", None, None)]
        assert records[0]["site"] == f"{HERE}:{_line_of('comm-a')} in comm_records"
        assert records[3]["site"] == records[4]["site"] == f"{HERE}:{_line_of('comm-x')} in comm_records"
        assert records[3]["batch"] == records[4]["batch"] == records[3]["seq"]  # one batch, named by its first
        assert records[5]["batch"] is None  # a plain send/recv
        assert all(r["group"] == "dp" and r["ranks"] == [0, 1] for r in records)


# ---------------------------------------------------------------------------------------------------------------
# The trainer's hook
# ---------------------------------------------------------------------------------------------------------------


def test_recording_writes_on_an_exception_but_not_on_a_bad_setting(tmp_path):
    recorder = FlightRecorder(rank=1)
    recorder.record("dp", (0, 1), "all_reduce", (1,), torch.float32)
    with pytest.raises(ConfigError), recording(recorder, tmp_path, 1, ignore=(ConfigError,)):
        raise ConfigError("bad")
    assert not flight_path(tmp_path, 1).exists()
    with pytest.raises(RuntimeError), recording(recorder, tmp_path, 1, ignore=(ConfigError,)):
        raise RuntimeError("[/x/pair.cc:1] Timed out waiting 3000ms\nmore")
    dump = json.loads(flight_path(tmp_path, 1).read_text())
    assert dump["reason"] == "RuntimeError: Timed out waiting 3000ms" and len(dump["records"]) == 1
    with recording(None, tmp_path / "none", 0):  # no recorder: nothing installed, nothing written
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with recording(recorder, tmp_path, 1, signals=()):  # a process whose signals belong to its launcher
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd was set either
    assert not (tmp_path / "none").exists()


def _wait_for(path, seconds: float = 5.0) -> bool:
    give_up = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < give_up:
        time.sleep(0.01)
    return path.exists()


def test_sigusr1_writes_and_the_run_goes_on(tmp_path):
    if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        pytest.skip("SIGUSR1 is taken by someone else in this process")  # the hook leaves it alone then
    recorder = FlightRecorder(rank=0)
    recorder.record("dp", (0, 1), "all_reduce", (1,), torch.float32)
    with recording(recorder, tmp_path, 0):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(flight_path(tmp_path, 0))
    assert json.loads(flight_path(tmp_path, 0).read_text())["reason"] == "signal SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # restored


def sigterm_while_blocked(out: str) -> None:
    """Rank function: SIGTERM arrives while the main thread is blocked in a collective that will never finish."""
    rank = dist.get_rank()
    recorder = FlightRecorder(rank)
    comm = Comm(name="world", recorder=recorder)
    with recording(recorder, out, rank, signals=(signal.SIGTERM,)):  # SIGUSR1 is the launcher's stack dump
        if rank == 0:  # delivered while the all-reduce below waits for rank 1
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        comm.all_reduce(torch.ones(1)) if rank == 0 else time.sleep(30)


def test_sigterm_writes_even_while_blocked_then_ends_the_rank(tmp_path):
    with pytest.raises(RankFailed, match=f"exited with code {128 + signal.SIGTERM}"):
        run_ranks(sigterm_while_blocked, 2, str(tmp_path), timeout=20, threads_per_rank=1)
    dump = json.loads(flight_path(tmp_path, 0).read_text())
    assert dump["reason"] == "signal SIGTERM" and [r["op"] for r in dump["records"]] == ["all_reduce"]


# ---------------------------------------------------------------------------------------------------------------
# The diff, on hand-made records
# ---------------------------------------------------------------------------------------------------------------


def _rec(seq, op, index, shape=(4,), group="dp", ranks=(0, 1), dtype="float32", peer=None, batch=None, site="a.py:1",
         detail=None):
    return {"seq": seq, "group": group, "ranks": list(ranks), "op": op, "index": index, "shape": list(shape),
            "dtype": dtype, "peer": peer, "batch": batch, "detail": detail, "site": site}


def _dumps(*per_rank, ranks=None):
    ranks = ranks if ranks is not None else range(len(per_rank))
    return {r: {"format": FORMAT, "rank": r, "reason": "test", "records": list(records)}
            for r, records in zip(ranks, per_rank)}


def _only(findings, kind):
    assert findings, "no divergence found"
    assert findings[0].kind == kind, [f.message for f in findings]
    return findings[0]


def test_diff_agreeing_records_find_nothing():
    same = [_rec(0, "all_reduce", 0), _rec(1, "all_reduce", 1, shape=(2,))]
    p2p0 = [_rec(2, "recv", 0, peer=1, batch=2), _rec(3, "send", 0, peer=1, batch=2)]
    p2p1 = [_rec(2, "recv", 0, peer=0, batch=2), _rec(3, "send", 0, peer=0, batch=2)]
    assert diff(_dumps(same + p2p0, same + p2p1)) == []
    # all_to_all rows may differ across ranks (uneven splits)
    assert diff(_dumps([_rec(0, "all_to_all", 0, shape=(3, 8))], [_rec(0, "all_to_all", 0, shape=(5, 8))])) == []


def test_diff_names_the_rank_that_skipped_a_collective():
    rank0 = [_rec(0, "all_reduce", 0, site="a.py:10"), _rec(1, "all_reduce", 1, site="a.py:11"),
             _rec(2, "all_reduce", 2, site="a.py:12")]
    rank1 = [_rec(0, "all_reduce", 0, site="a.py:10"), _rec(1, "all_reduce", 1, site="a.py:12")]
    f = _only(diff(_dumps(rank0, rank1)), "skipped")
    assert (f.rank, f.index, f.group) == (1, 1, "dp") and "a.py:11" in f.message
    # the same, the other way round
    f = _only(diff(_dumps(rank1, rank0)), "skipped")
    assert (f.rank, f.index) == (0, 1)


def test_diff_names_mismatched_shape_dtype_and_op():
    for change, word in (({"shape": (5,)}, "shape"), ({"dtype": "bfloat16"}, "dtype"), ({"detail": "max"},
                                                                                       "reduce op")):
        base = _rec(7, "all_reduce", 0, detail="sum")
        f = _only(diff(_dumps([base], [{**base, **{k: list(v) if k == "shape" else v
                                                   for k, v in change.items()}}])), "mismatch")
        assert f.index == 0 and word in f.message, f.message
    f = _only(diff(_dumps([_rec(0, "all_reduce", 0)], [_rec(0, "all_gather", 0)])), "mismatch")
    assert "op" in f.message and "all_gather" in f.message
    # three ranks: the odd one out is named
    f = _only(diff(_dumps([_rec(0, "all_reduce", 0, ranks=(0, 1, 2))], [_rec(0, "all_reduce", 0, ranks=(0, 1, 2))],
                          [_rec(0, "all_reduce", 0, ranks=(0, 1, 2), shape=(3,))])), "mismatch")
    assert f.rank == 2


def test_diff_names_a_missing_call_and_a_rank_without_record():
    rank0 = [_rec(0, "all_reduce", 0), _rec(1, "all_reduce", 1, site="b.py:2")]
    rank1 = [_rec(0, "all_reduce", 0), _rec(1, "all_reduce", 0, group="tp", ranks=(1, 2), site="c.py:3")]
    f = _only(diff(_dumps(rank0, rank1)), "missing")
    assert (f.rank, f.index) == (1, 1) and "b.py:2" in f.message and "c.py:3" in f.message  # where rank 1 is
    dumps = _dumps(rank0, [_rec(5, "all_reduce", 0, group="tp", ranks=(1, 2))])
    dumps[1]["dropped"] = 5  # rank 1's dp calls may have left its ring: nothing to say about them
    assert [f.kind for f in diff(dumps)] == ["no-record"]  # rank 2 of tp left none
    findings = diff(_dumps([_rec(0, "all_reduce", 0)]))  # rank 1 left nothing
    f = _only(findings, "no-record")
    assert f.rank == 1 and "rank 0" in f.message


def test_diff_names_p2p_shape_mismatch_order_and_unmatched():
    # The i-th send meets the i-th receive: a different shape there is named on the receiving rank.
    f = _only(diff(_dumps([_rec(0, "send", 0, peer=1, shape=(2, 4))], [_rec(0, "recv", 0, peer=0, shape=(4, 2))])),
              "p2p-mismatch")
    assert f.rank == 1 and "(2, 4)" in f.message and "(4, 2)" in f.message
    # Both send first, each blocked before posting its receive.
    findings = diff(_dumps([_rec(0, "send", 0, peer=1, site="s.py:1")], [_rec(0, "send", 0, peer=0, site="s.py:1")]))
    assert [(f.kind, f.rank) for f in findings] == [("p2p-order", 0), ("p2p-order", 1)]
    assert "s.py:1" in findings[0].message
    # Both posted everything, unbatched, sends first: on one pair stream each, the heads are two sends.
    rank0 = [_rec(0, "send", 0, peer=1), _rec(1, "recv", 0, peer=1)]
    rank1 = [_rec(0, "send", 0, peer=0), _rec(1, "recv", 0, peer=0)]
    f = _only(diff(_dumps(rank0, rank1)), "p2p-order")
    assert "cannot meet its match" in f.message
    # The same posted as one batch per rank: NCCL groups them, nothing to report.
    rank0 = [_rec(0, "send", 0, peer=1, batch=0), _rec(1, "recv", 0, peer=1, batch=0)]
    rank1 = [_rec(0, "send", 0, peer=0, batch=0), _rec(1, "recv", 0, peer=0, batch=0)]
    assert diff(_dumps(rank0, rank1)) == []
    # Rank 1 waits for a third message rank 0 never sends.
    rank0 = [_rec(0, "send", 0, peer=1), _rec(1, "send", 1, peer=1)]
    rank1 = [_rec(0, "recv", 0, peer=0), _rec(1, "recv", 1, peer=0), _rec(2, "recv", 2, peer=0, site="r.py:9")]
    f = _only(diff(_dumps(rank0, rank1)), "p2p-unmatched")
    assert (f.rank, f.index) == (1, 2) and "r.py:9" in f.message and "only 2" in f.message


# ---------------------------------------------------------------------------------------------------------------
# Loading and the command line
# ---------------------------------------------------------------------------------------------------------------


def _write(out, dumps):
    (out / "flight").mkdir(parents=True, exist_ok=True)
    for r, dump in dumps.items():
        (out / "flight" / f"rank{r}.json").write_text(json.dumps(dump))


def test_load_refuses_what_is_not_a_flight_record(tmp_path):
    with pytest.raises(FlightError, match="no flight records"):
        load(tmp_path)
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "rank0.json").write_text("not json")
    with pytest.raises(FlightError, match="not a readable JSON"):
        load(tmp_path)
    (tmp_path / "flight" / "rank0.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(FlightError, match="not a flight record"):
        load(tmp_path)
    for bad, what in (({"shape": "4"}, "shape"), ({"ranks": [2, 3]}, "ranks/shape"), ({"op": "send"}, "peer"),
                      ({"op": "recv", "peer": 1, "batch": "x"}, "batch")):
        _write(tmp_path, _dumps([{**_rec(0, "all_reduce", 0), **bad}]))
        with pytest.raises(FlightError, match=rf"record 0 is malformed \({what}\)"):
            load(tmp_path)


def test_command_line_exit_codes_and_report(tmp_path, capsys):
    assert debug_main(["diff", str(tmp_path)]) == 2
    assert "no flight records" in capsys.readouterr().err
    _write(tmp_path, _dumps([_rec(0, "all_reduce", 0)], [_rec(0, "all_reduce", 0)]))
    assert debug_main(["diff", str(tmp_path)]) == 0
    assert "the ranks agree" in capsys.readouterr().out
    _write(tmp_path, _dumps([_rec(0, "all_reduce", 0)], [_rec(0, "all_reduce", 0, shape=(9,))]))
    assert debug_main(["diff", str(tmp_path / "flight")]) == 1
    text = capsys.readouterr().out
    assert "first divergence (mismatch)" in text and "(9,)" in text
    assert text.strip() == report(load(tmp_path), diff(load(tmp_path)))
    assert "warning" not in text
    stale = _dumps([_rec(0, "all_reduce", 0)], [_rec(0, "all_reduce", 0)])
    stale[0]["started_at"], stale[1]["started_at"] = 1000.0, 1000.0 + 3600  # rank 0's file is an hour older
    assert "warning: these records come from jobs started 3600 s apart (rank 0's is the oldest)" in report(stale, [])
    stale[0]["started_at"] = 1000.0 + 3599  # one job: its ranks start within a moment
    assert "warning" not in report(stale, [])
    # A live dump (SIGUSR1): a rank one call behind its peer is only a note's worth, a shape mismatch is not.
    behind = _dumps([_rec(0, "all_reduce", 0), _rec(1, "all_reduce", 1)], [_rec(0, "all_reduce", 0)])
    for dump in behind.values():
        dump["reason"] = "signal SIGUSR1"
    assert "may only be timing" in report(behind, diff(behind))
    behind[1]["records"][0]["shape"] = [9]
    assert "may only be timing" not in report(behind, diff(behind))
