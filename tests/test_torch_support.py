"""The oldest torch the package supports: pyproject's floor, the names the package calls, and the one-line error the
trainer gives on a torch that is too old (a GPU node keeps its own torch, which may be older than this machine's)."""

import ast
import tomllib
import types
from pathlib import Path

import pytest
import torch.distributed as dist
from test_architecture import TORCH_2_11_DISTRIBUTED, distributed_names, sources

from minidist.comm import torch_support
from minidist.comm.torch_support import DISTRIBUTED_NAMES, OLDEST_TORCH, check_torch, release
from minidist.train import loop as train

ROOT = Path(__file__).resolve().parents[1]


def test_the_floor_is_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(d for d in project["dependencies"] if d.replace(" ", "").startswith("torch>="))
    assert release(spec.replace(" ", "")[len("torch>="):]) == OLDEST_TORCH


def test_the_name_list_is_exactly_what_the_package_reads_and_torch_2_11_has_it():
    used = set().union(*(distributed_names(tree) for _, tree in sources().values()))
    assert used == DISTRIBUTED_NAMES, (f"used but not listed: {sorted(used - DISTRIBUTED_NAMES)}; "
                                       f"listed but unused: {sorted(DISTRIBUTED_NAMES - used)}")
    assert DISTRIBUTED_NAMES <= TORCH_2_11_DISTRIBUTED, sorted(DISTRIBUTED_NAMES - TORCH_2_11_DISTRIBUTED)
    assert distributed_names(ast.parse("import torch.distributed as dist\ndist.send(x, 1)\n")) == {"send"}


@pytest.mark.parametrize(("version", "expected"), [("2.11.0+cu130", (2, 11)), ("2.13.0a0+git1f2e3d", (2, 13)),
                                                   ("3.0.1", (3, 0)), ("2.9.1", (2, 9))])
def test_release_reads_local_and_prerelease_versions(version, expected):
    assert release(version) == expected


def test_this_torch_passes_and_an_old_or_incomplete_one_fails_in_one_line():
    check_torch()
    with pytest.raises(ValueError, match=r"^torch 2\.10\.1\+cu128 is older than 2\.11") as old:
        check_torch("2.10.1+cu128")
    assert "\n" not in str(old.value)
    present = {n: getattr(dist, n) for n in DISTRIBUTED_NAMES - {"reduce_scatter_tensor", "is_available"}}
    lacking = types.SimpleNamespace(is_available=lambda: True, **present)
    with pytest.raises(ValueError, match=r"lacks reduce_scatter_tensor, which this package calls"):
        check_torch("2.11.0", lacking)


def test_the_trainer_refuses_an_old_torch_before_any_process_group(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch_support.torch, "__version__", "2.9.0")
    code = train.main(["--model", "tiny", "--steps", "1", "--out", str(tmp_path / "run")])
    assert code == 2 and "torch 2.9.0 is older than 2.11" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
