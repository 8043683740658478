"""The layouts a user can run: a stack's abilities and `--restrict "zero=0,1 schedule=1f1b cp=1 recompute=none"`
as one record the search filters by (chapter 12), and `--micro-batch-size` (sequences per micro-batch: the number
of micro-batches follows from the global batch, dp and B)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minidist.parallel.layout import Layout
from minidist.plan.stack import CP_KINDS, RECOMPUTES, SCHEDULES, Stack

# --restrict's keys: the degrees take whole numbers, the rest their names
DEGREES = ("dp", "tp", "pp", "cp", "ep", "zero", "microbatches", "virtual_stages")
NAMES = {"schedule": SCHEDULES, "recompute": RECOMPUTES, "cp_impl": (*CP_KINDS, "ulysses")}
MAX_VALUES = 64  # values per key: a restriction names a few


@dataclass(frozen=True)
class Restrict:
    """Allowed values per setting (`Layout.flat()`'s names; a missing key: anything), tp's most, and the
    sequences per micro-batch (0: the search chooses the micro-batches)."""

    allowed: tuple[tuple[str, tuple], ...] = ()
    max_tp: int = 0
    micro_batch_size: int = 0

    def values(self, key: str) -> tuple | None:
        return dict(self.allowed).get(key)

    def admits(self, layout: Layout) -> bool:
        flat = layout.flat()
        if self.max_tp and layout.dims.tp > self.max_tp:
            return False
        for key, values in self.allowed:
            if key == "cp_impl" and layout.dims.cp == 1:
                continue  # no context parallelism: its implementation does not matter
            if flat[key] not in values:
                return False
        return True

    def admits_degree(self, key: str, value: int) -> bool:
        """Whether a grid degree (dp, tp, pp, cp) may take `value`: pruned before the inner loops."""
        values = self.values(key)
        if key == "tp" and self.max_tp and value > self.max_tp:
            return False
        return values is None or value in values

    def joined(self, other: Restrict) -> Restrict:
        """Both restrictions at once (values allowed by both; the smaller tp limit; B from either)."""
        mine, theirs = dict(self.allowed), dict(other.allowed)
        keys = list(dict.fromkeys([*mine, *theirs]))
        allowed = tuple((k, tuple(v for v in mine[k] if v in theirs[k]) if k in mine and k in theirs
                         else mine.get(k, theirs.get(k))) for k in keys)
        max_tp = min((t for t in (self.max_tp, other.max_tp) if t), default=0)
        return Restrict(allowed, max_tp, self.micro_batch_size or other.micro_batch_size)


ANYTHING = Restrict()  # no restriction


def of_stack(stack: Stack) -> Restrict:
    """What a stack can run, as a restriction (its schedules, ZeRO stages, context parallelism, recomputation,
    tp's most)."""
    allowed: list[tuple[str, tuple]] = [("schedule", stack.schedules), ("zero", stack.zero_stages),
                                        ("recompute", stack.recompute)]
    if not stack.sequence_parallel:
        allowed.append(("sequence_parallel", (False,)))
    if not stack.cp:
        allowed.append(("cp", (1,)))
    else:
        allowed.append(("cp_impl", stack.cp))
    return Restrict(tuple(allowed), stack.max_tp)


def parse_restrict(text: str) -> Restrict:
    """'zero=0,1 schedule=1f1b cp=1 recompute=none' -> a Restrict (one-line ValueError for anything else)."""
    allowed: dict[str, tuple] = {}
    for item in text.split():
        key, eq, value = item.partition("=")
        if not eq or key not in (*DEGREES, *NAMES) or not value:
            raise ValueError(f"--restrict {item[:60]!r} is not KEY=V1,V2 with a key of {', '.join((*DEGREES, *NAMES))}")
        parts = value.split(",")
        if len(parts) > MAX_VALUES:
            raise ValueError(f"--restrict {key}: {len(parts)} values, more than {MAX_VALUES}")
        if key in NAMES:
            bad = [p for p in parts if p not in NAMES[key]]
            if bad:
                raise ValueError(f"--restrict {key}={bad[0][:40]!r} is unknown; choose of {', '.join(NAMES[key])}")
            allowed[key] = tuple(parts)
        else:
            if not all(p.isdigit() and len(p) <= 9 for p in parts):
                raise ValueError(f"--restrict {key}={value[:60]!r}: whole numbers separated by commas")
            allowed[key] = tuple(int(p) for p in parts)
    return Restrict(tuple(allowed.items()))


def with_micro_batch_size(restrict: Restrict, size: int) -> Restrict:
    if size < 0 or size > 1 << 30:
        raise ValueError(f"--micro-batch-size must be >= 1 sequences, got {size}")
    return dataclasses.replace(restrict, micro_batch_size=size)
