"""Shared test setup: the repository root on sys.path, and `--impl` to choose which exercise answers to grade."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# `exercises` and `solutions` are top-level packages of the repository, not of the installed minidist. Putting the
# root on sys.path before any launch also lets rank processes import them (they inherit the parent's sys.path).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMPLEMENTATIONS = ("solutions", "exercises")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--impl", choices=IMPLEMENTATIONS, default="solutions",
                     help="which package tests/exercises grades: the reference `solutions` (default) or your "
                          "`exercises`")


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest) -> str:
    """The package name whose chapter modules tests/exercises grades ("solutions" or "exercises")."""
    return request.config.getoption("--impl")


@pytest.fixture
def one_thread():
    """Tiny single-process runs: a second thread gains nothing, and OpenMP threads spin badly on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
