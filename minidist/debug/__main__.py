"""`python -m minidist.debug diff OUT`: line up the ranks' flight records and name the first divergence.

Exit status: 0 when the records agree, 1 when a divergence is found (so scripts can test for it), 2 when OUT holds
no readable flight records (one line on stderr saying what is wrong and what would fit).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from minidist.debug.diff import FlightError, diff, load, report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minidist.debug",
                                     description="Tools for debugging distributed runs (chapter 14).")
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser(
        "diff", help="line up the ranks' flight records (OUT/flight/rank<R>.json) and name the first divergence",
        description="Line up the flight records every rank writes to OUT/flight/ when a run fails, times out or is "
                    "signalled (SIGTERM, SIGUSR1), group by group, and name the first call where they diverge: a "
                    "rank that skipped or never made a collective, mismatched op/shape/dtype, a p2p order NCCL "
                    "cannot match, messages one side never posts. Exit status 0: the records agree; 1: a "
                    "divergence was found; 2: no readable records.")
    cmd.add_argument("out", type=Path, help="the run's --out directory (or its flight/ directory)")
    args = parser.parse_args(argv)
    try:
        dumps = load(args.out)
    except FlightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    findings = diff(dumps)
    print(report(dumps, findings))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
