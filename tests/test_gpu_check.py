"""scripts/gpu_check.sh, the one prepared check for a GPU machine: its CPU path runs here so it cannot rot; the GPU
configs it and the README use parse and pass the layout checks for their GPU counts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.train.config import parse_config
from minidist.train.preflight import resolve_layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("path", "world"), [("configs/gpu/dense-1b.toml", 1), ("configs/gpu/llama3-8b-8gpu.toml", 8)])
def test_gpu_configs_parse_and_fit_their_gpu_count(path, world):
    cfg = parse_config(["--config", str(ROOT / path)])
    dims = resolve_layout(cfg, world).dims
    assert dims.dp * dims.tp * dims.pp * dims.cp == world and cfg.dtype == "auto"


@pytest.mark.timeout(240)
def test_gpu_check_cpu_path_runs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out",
                             str(tmp_path)], capture_output=True, text=True, env=env, timeout=230)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "parity ok" in result.stdout and "gpu_check: all checks passed" in result.stdout
    assert "dense-1b:" in result.stdout and "tokens/s" in result.stdout and "peak memory" in result.stdout
    assert (tmp_path / "tiny-device" / "metrics.jsonl").exists() and (tmp_path / "tiny-cpu" / "metrics.jsonl").exists()
