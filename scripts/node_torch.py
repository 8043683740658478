"""Print the version of the torch this Python already has, if it satisfies pyproject.toml's `torch>=` floor, else
nothing (exit 0 either way). The Makefile and scripts/install_gpu_node.sh keep such a torch (a GPU node's CUDA
build) instead of installing the CPU wheel over it. Standard library only; runs under any Python 3."""

import re
import sys
from pathlib import Path


def floor(pyproject: Path) -> tuple[int, ...]:
    match = re.search(r'"torch\s*>=\s*([\d.]+)"', pyproject.read_text())
    if match is None:
        sys.exit(f"{pyproject}: no torch>= requirement")
    return tuple(int(x) for x in match.group(1).split("."))


def release(version: str) -> tuple[int, ...]:
    """'2.12.0+cu128' -> (2, 12, 0); '2.13.0a0+git1234' -> (2, 13, 0): the numeric release, local tags dropped."""
    numbers = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in numbers.group(1).split(".")) if numbers else ()


def main() -> None:
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch, or one that does not import: install ours
        return
    needed = floor(Path(__file__).resolve().parents[1] / "pyproject.toml")
    have = release(torch.__version__)
    if have[:len(needed)] >= needed:
        print(torch.__version__)


if __name__ == "__main__":
    main()
