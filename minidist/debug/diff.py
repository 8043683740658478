"""Line the ranks' flight records up and name where they diverge (`python -m minidist.debug diff OUT`).

Every record carries its index (`minidist.comm.recorder`): the k-th collective of a group on one rank must meet
the k-th collective of that group on every other member, and the i-th send from a to b the i-th receive b posts
from a (NCCL has no tags). So for each group:

- **collectives**: compare the k-th call of every member, k = 0, 1, ...; the first k where they differ is the
  group's divergence. A member without a k-th call *is missing* it (it is stuck elsewhere, or left); a member
  whose k-th call is the others' (k+1)-th *skipped* the others' k-th (a branch only some ranks take); otherwise
  the calls *mismatch* (op, shape, dtype, reduce op or source, or call site: the same op from different lines
  means the ranks are out of step).
- **point-to-point**: per ordered pair, the i-th send against the i-th receive: shapes and dtypes must agree.
  Then the posts are replayed under NCCL's rules (`minidist.parallel.pp.nccl_model.replay`, each batch as one NCCL
  group, each single isend/irecv on its pair's stream): ranks stuck on operations towards each other that the peer
  posted, or sends both ways that neither side's receive will ever meet first, are *an order NCCL cannot match*; a stuck
  operation whose peer never posted its match is *unmatched* (the ranks disagree on how many messages pass).

A rank that wrote no record is named too (it died, was frozen or killed before it could write). When every call
lines up, a rank blocked in no call while a peer waits for it in one (`waiting_on` of the records) is named: it is
alive but stuck outside communication (compute, I/O, a call the recorder does not see). Findings are
listed in the order the named rank made the calls; the first one is "the first divergence".
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minidist.comm.recorder import FORMAT, P2P_OPS
from minidist.parallel.pp.nccl_model import RECV, SEND, Op, Post, replay

_FIELDS = {"seq": int, "group": str, "ranks": list, "op": str, "index": int, "shape": list, "site": str}
_MAX_RANKS = 1 << 16
_MAX_RECORD_BYTES = 256 << 20  # a flight record of 2000 calls is ~0.5 MB; a bound on hostile input
TAIL_KINDS = ("missing", "p2p-unmatched", "outside")  # what a rank that is merely behind its peers also looks like
STALE_S = 60.0  # the ranks of one job mark their start within a moment of each other (`FlightRecorder.start`)


class FlightError(ValueError):
    """OUT holds no flight records, or a file that is not one: one line saying which and what would fit."""


@dataclass(frozen=True)
class Finding:
    kind: str  # no-record, missing, skipped, mismatch, p2p-mismatch, p2p-order, p2p-unmatched, outside
    rank: int  # the rank named
    group: str
    ranks: tuple[int, ...]
    index: int | None  # the call's index (see the module docstring); None for no-record
    seq: int  # the named call's seq on `rank` (-1 for no-record), for ordering
    message: str


# ---------------------------------------------------------------------------------------------------------------
# Loading (JSON only, every field checked)
# ---------------------------------------------------------------------------------------------------------------


def load(out: Path) -> dict[int, dict[str, Any]]:
    """The records in `out/flight/` (or in `out` itself if it is the flight directory), by rank."""
    out = Path(out)
    folder = out / "flight" if (out / "flight").is_dir() else out
    if not folder.is_dir():
        raise FlightError(f"{out} is not a directory; give the run's --out directory (its flight/ holds the records)")
    files = sorted(folder.glob("rank*.json"))
    if not files:
        raise FlightError(f"no flight records in {folder} (expected flight/rank<R>.json, written when a run fails, "
                          "times out or gets SIGTERM/SIGUSR1)")
    dumps = {}
    for path in files:
        dump = _read(path)
        if dump["rank"] in dumps:
            raise FlightError(f"{path}: rank {dump['rank']} has two records in {folder}")
        dumps[dump["rank"]] = dump
    return dumps


def _read(path: Path) -> dict[str, Any]:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_RECORD_BYTES:  # a FIFO would block the read forever
            raise OSError(f"not a regular file of at most {_MAX_RECORD_BYTES >> 20} MiB")
        dump = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FlightError(f"{path}: not a readable JSON flight record ({e.__class__.__name__}: {e})") from None
    if not isinstance(dump, dict) or dump.get("format") != FORMAT:
        raise FlightError(f"{path}: not a flight record (expected a JSON object with \"format\": \"{FORMAT}\")")
    rank, records = dump.get("rank"), dump.get("records")
    if not isinstance(rank, int) or not 0 <= rank < _MAX_RANKS or not isinstance(records, list) or not isinstance(
            dump.get("waiting_on"), int | None):
        raise FlightError(f"{path}: needs an integer \"rank\", a list \"records\" and \"waiting_on\" an integer "
                          "or null")
    for i, rec in enumerate(records):
        bad = [k for k, t in _FIELDS.items() if not isinstance(rec, dict) or not isinstance(rec.get(k), t)]
        if not bad and not (all(isinstance(r, int) for r in rec["ranks"] + rec["shape"]) and rank in rec["ranks"]):
            bad = ["ranks/shape"]
        if not bad and rec["op"] in P2P_OPS and not (isinstance(rec.get("peer"), int) and rec["peer"] in rec["ranks"]):
            bad = ["peer"]
        if not bad and not (rec.get("batch") is None or isinstance(rec["batch"], int)):
            bad = ["batch"]
        if bad:
            raise FlightError(f"{path}: record {i} is malformed ({', '.join(bad)}); every record needs "
                              f"{', '.join(_FIELDS)} with this rank among its ranks (sends and receives: a peer among "
                              "them, batch an integer or null)")
    return dump


# ---------------------------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------------------------


def describe(rec: dict[str, Any], with_group: bool = False) -> str:
    """'all_reduce (4,) float32 sum at parallel/zero.py:123 in step'."""
    shape = "(" + ", ".join(map(str, rec["shape"])) + ("," if len(rec["shape"]) == 1 else "") + ")"
    parts = [rec["op"], shape, str(rec.get("dtype"))]
    if rec.get("detail"):
        parts.append(str(rec["detail"]))
    if rec.get("peer") is not None:
        parts.append(("to" if rec["op"] == "send" else "from") + f" rank {rec['peer']}")
    if with_group:
        parts.append(f"on {rec['group']} {rec['ranks']}")
    return " ".join(parts) + f" at {rec['site']}"


def _signature(rec: dict[str, Any]) -> tuple:
    shape = rec["shape"][1:] if rec["op"] == "all_to_all" else rec["shape"]  # its rows may differ across ranks
    return rec["op"], tuple(shape), rec.get("dtype"), rec.get("detail"), rec["site"]


def _last(dump: dict[str, Any]) -> str:
    records = dump["records"]
    return f"its last call was {describe(records[-1], with_group=True)}" if records else "it recorded no call"


def diff(dumps: dict[int, dict[str, Any]]) -> list[Finding]:
    """Every divergence between the ranks' records, the first one first (module docstring)."""
    groups: dict[tuple[str, tuple[int, ...]], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rank, dump in dumps.items():
        for rec in dump["records"]:
            groups[rec["group"], tuple(rec["ranks"])][rank].append(rec)
    findings = []
    absent: set[int] = set()
    for (name, ranks), by_rank in sorted(groups.items()):
        absent |= {r for r in ranks if r not in dumps}
        findings += _collectives(name, ranks, by_rank, dumps)
        findings += _p2p(name, ranks, by_rank, dumps)
    for r in sorted(absent):
        with_it = [f"rank {o} ({_last(dumps[o])})" for o in sorted(dumps)
                   if any(r in g for (_, g), by in groups.items() if o in by)]
        findings.append(Finding("no-record", r, "", (), None, -1,
                                f"rank {r} wrote no flight record: it died, was frozen or was killed before it "
                                f"could write. Its peers: {'; '.join(with_it)}"))
    if not findings:  # the calls agree; a hang then may be a rank blocked in no call at all
        findings = _outside(dumps)
    order = {"p2p-order": 0, "skipped": 1, "mismatch": 1, "p2p-mismatch": 1, "p2p-unmatched": 2, "missing": 2,
             "outside": 2, "no-record": 3}
    return sorted(findings, key=lambda f: (order[f.kind], f.seq, f.rank))


def _outside(dumps: dict[int, dict[str, Any]]) -> list[Finding]:
    """A rank blocked in no call while a peer waits for it in one: alive but stuck outside communication (in
    compute, I/O, or a call the recorder does not see), a hang every record's calls agree about."""
    found = []
    blocked = {r: d["waiting_on"] for r, d in dumps.items() if isinstance(d.get("waiting_on"), int)}
    for r in sorted(set(dumps) - set(blocked)):
        for b, seq in sorted(blocked.items()):
            rec = next((x for x in dumps[b]["records"] if x["seq"] == seq), None)
            if rec is not None and r in rec["ranks"]:
                last = dumps[r]["records"][-1]["seq"] if dumps[r]["records"] else -1
                found.append(Finding("outside", r, rec["group"], tuple(rec["ranks"]), rec["index"], last,
                                     f"rank {r} is blocked in no call while rank {b} waits for it in "
                                     f"{describe(rec, with_group=True)}: rank {r} is stuck outside communication "
                                     f"(compute, I/O, or a call the recorder does not see); {_last(dumps[r])}"))
                break
    return found


def _collectives(name: str, ranks: tuple[int, ...], by_rank: dict[int, list[dict]],
                 dumps: dict[int, dict]) -> list[Finding]:
    calls = {r: {rec["index"]: rec for rec in by_rank.get(r, []) if rec["op"] not in P2P_OPS}
             for r in ranks if r in dumps}
    # A rank whose ring dropped calls and kept none of this group's cannot be compared: its calls may have left it.
    calls = {r: c for r, c in calls.items() if c or not dumps[r].get("dropped")}
    if len(calls) < 2 or not any(calls.values()):
        return []
    # Older calls may have left a ring: compare from the first index every rank still holds.
    start = max((min(c) if c else 0) for c in calls.values() if c)
    stop = max(max(c) for c in calls.values() if c) + 1
    for k in range(start, stop):
        at = {r: c.get(k) for r, c in calls.items()}
        present = {r: rec for r, rec in at.items() if rec is not None}
        sigs = {r: _signature(rec) for r, rec in present.items()}
        if len(present) == len(at) and len(set(sigs.values())) == 1:
            continue
        where = f"{name} {list(ranks)}, collective #{k}"
        if len(present) < len(at):
            made = next(iter(present.values()))
            return [Finding("missing", r, name, ranks, k, dumps[r]["records"][-1]["seq"] if dumps[r]["records"]
                            else -1, f"{where}: rank {r} never made it; rank(s) {sorted(present)} called "
                            f"{describe(made)}; rank {r}: {_last(dumps[r])}")
                    for r, rec in at.items() if rec is None]
        skipped = [r for r in present if any(
            sigs[r] != sigs[o] and (nxt := calls[o].get(k + 1)) is not None and _signature(nxt) == sigs[r]
            for o in present)]
        if skipped and len(skipped) < len(present):
            other = next(r for r in present if r not in skipped)
            return [Finding("skipped", r, name, ranks, k, present[r]["seq"],
                            f"{where}: rank {r} skipped {describe(present[other])} that rank {other} made; rank "
                            f"{r}'s #{k} is rank {other}'s #{k + 1}: {describe(present[r])}") for r in skipped]
        # The minority (or, at a tie, every rank but the first) is named.
        variants: dict[tuple, list[int]] = defaultdict(list)
        for r, s in sigs.items():
            variants[s].append(r)
        majority = max(variants.values(), key=len)
        fields = [f for f, i in (("op", 0), ("shape", 1), ("dtype", 2), ("reduce op/source", 3), ("call site", 4))
                  if len({s[i] for s in sigs.values()}) > 1]
        lines = "; ".join(f"rank {r}: {describe(rec)}" for r, rec in present.items())
        return [Finding("mismatch", r, name, ranks, k, present[r]["seq"],
                        f"{where}: the ranks disagree on {', '.join(fields)}: {lines}")
                for r in present if r not in majority][:1]
    return []


def _p2p(name: str, ranks: tuple[int, ...], by_rank: dict[int, list[dict]],
         dumps: dict[int, dict]) -> list[Finding]:
    sends, recvs = defaultdict(dict), defaultdict(dict)  # (src, dst) -> index -> record
    for r, records in by_rank.items():
        for rec in records:
            if rec["op"] == "send":
                sends[r, rec["peer"]][rec["index"]] = rec
            elif rec["op"] == "recv":
                recvs[rec["peer"], r][rec["index"]] = rec
    if not sends and not recvs:
        return []
    findings = []
    for pair in sorted(set(sends) & set(recvs)):
        for i in sorted(set(sends[pair]) & set(recvs[pair])):
            s, v = sends[pair][i], recvs[pair][i]
            if (s["shape"], s.get("dtype")) != (v["shape"], v.get("dtype")):
                findings.append(Finding(
                    "p2p-mismatch", pair[1], name, ranks, i, v["seq"],
                    f"{name} {list(ranks)}, message #{i} from rank {pair[0]} to rank {pair[1]}: sent "
                    f"{describe(s)}, but the receive is {describe(v)}"))
                break
    complete = all(r in dumps for r in ranks) and all(
        min(d) == 0 for d in [*sends.values(), *recvs.values()])
    if complete:
        findings += _replay(name, ranks, by_rank, sends, recvs)
    return findings


def _replay(name: str, ranks: tuple[int, ...], by_rank: dict[int, list[dict]], sends: dict, recvs: dict
            ) -> list[Finding]:
    """Replay the posts under NCCL's rules; name what the stuck ranks wait for."""
    index = {r: i for i, r in enumerate(ranks)}
    programs: list[list[Post]] = []
    of_op: dict[tuple[int, Op], dict] = {}
    for r in ranks:
        batches: dict[int, list[dict]] = {}
        posts: list[tuple[int, list[dict]]] = []
        for rec in by_rank.get(r, []):
            if rec["op"] not in P2P_OPS:
                continue
            if rec.get("batch") is None:
                posts.append((rec["seq"], [rec]))
            elif rec["batch"] in batches:
                batches[rec["batch"]].append(rec)
            else:
                batches[rec["batch"]] = [rec]
                posts.append((rec["seq"], batches[rec["batch"]]))
        program = []
        for _, recs in posts:
            ops = []
            for rec in recs:
                src, dst = (r, rec["peer"]) if rec["op"] == "send" else (rec["peer"], r)
                op = Op(SEND if rec["op"] == "send" else RECV, index[rec["peer"]], (src, dst, rec["index"]))
                of_op[r, op] = rec
                ops.append(op)
            program.append(Post(tuple(ops), batched=recs[0].get("batch") is not None))
        programs.append(program)
    outcome = replay(programs)
    if not outcome.deadlock:
        return []
    stuck = {ranks[i]: [of_op[ranks[i], op] for op in ops] for i, ops in outcome.stuck.items()}
    findings = []
    for r, recs in sorted(stuck.items()):
        rec = min(recs, key=lambda x: x["seq"])
        peer = rec["peer"]
        partner = (recvs if rec["op"] == "send" else sends).get(
            (r, peer) if rec["op"] == "send" else (peer, r), {}).get(rec["index"])
        peer_sends_back = any(o["op"] == "send" and o["peer"] == r for o in stuck.get(peer, []))
        where = f"{name} {list(ranks)}: rank {r}'s {rec['op']} #{rec['index']} {describe(rec)}"
        if partner is not None:
            findings.append(Finding("p2p-order", r, name, ranks, rec["index"], rec["seq"],
                                    f"{where} cannot meet its match {describe(partner)} posted by rank {peer}: an "
                                    "order NCCL cannot match (each rank's operations run in posting order)"))
        elif rec["op"] == "send" and peer_sends_back:
            findings.append(Finding("p2p-order", r, name, ranks, rec["index"], rec["seq"],
                                    f"{where} waits for a receive rank {peer} has not posted, while rank {peer} "
                                    f"waits in a send to rank {r}: an order NCCL cannot match (both send first; "
                                    "post the pair together with Comm.exchange)"))
        else:
            count = len((sends if rec["op"] == "recv" else recvs).get((peer, r) if rec["op"] == "recv"
                                                                       else (r, peer), {}))
            did = "sent" if rec["op"] == "recv" else "posted receives for"
            findings.append(Finding("p2p-unmatched", r, name, ranks, rec["index"], rec["seq"],
                                    f"{where} has no match: rank {peer} {did} only {count} message(s) "
                                    f"{'to' if rec['op'] == 'recv' else 'from'} rank {r}; the ranks disagree on "
                                    "how many messages pass between them"))
    return findings


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def report(dumps: dict[int, dict[str, Any]], findings: list[Finding]) -> str:
    """What `python -m minidist.debug diff` prints."""
    lines = [f"flight records of rank(s) {sorted(dumps)}:"]
    starts = {r: d["started_at"] for r, d in dumps.items() if isinstance(d.get("started_at"), int | float)}
    spread = max(starts.values()) - min(starts.values()) if starts else 0.0
    if spread > STALE_S:
        oldest = min(starts, key=starts.get)
        lines.append(f"  warning: these records come from jobs started {spread:.0f} s apart (rank {oldest}'s is the "
                     "oldest): a stale file of an earlier job? Compare one job's records only")
    for r, dump in sorted(dumps.items()):
        dropped = f", {dump.get('dropped')} older dropped" if dump.get("dropped") else ""
        lines.append(f"  rank {r}: {len(dump['records'])} calls{dropped}, written on {dump.get('reason')!s}")
    if not findings:
        lines.append("the ranks agree: every group's calls line up")
        return "\n".join(lines)
    first, *rest = findings
    lines.append(f"first divergence ({first.kind}): {first.message}")
    lines += [f"then ({f.kind}): {f.message}" for f in rest]
    live = [r for r, d in sorted(dumps.items()) if str(d.get("reason")).startswith("signal SIGUSR1")]
    if live and all(f.kind in TAIL_KINDS for f in findings):
        lines.append(f"note: rank(s) {live} wrote on SIGUSR1 while running; each rank wrote at its own moment, so "
                     "calls its peers had not reached yet look missing or unmatched. A mismatch or a skipped call "
                     "would be a real divergence; these may only be timing.")
    return "\n".join(lines)
