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


@pytest.mark.timeout(300)
def test_gpu_check_cpu_path_runs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out",
                             str(tmp_path)], capture_output=True, text=True, env=env, timeout=290)
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-2000:]
    assert "torch check ok" in out and "sdpa MATH                 ok" in out and "comm gloo world 1 on cpu: ok" in out
    assert out.count("parity ok") == 2 and "checkpoint round trip" in out and "gpu_check: all checks passed" in out
    for variant in ("eager", "recompute"):
        assert f"dense-1b {variant}:" in out
    assert "tokens/s" in out and "peak memory" in out
    assert (tmp_path / "tiny-device" / "metrics.jsonl").exists() and (tmp_path / "tiny-cpu" / "metrics.jsonl").exists()
    assert (tmp_path / "tiny-resumed" / "checkpoints").is_dir()


def test_the_loss_comparison_fails_on_a_gap(tmp_path):
    """The script's parity verdict can fail: a run whose losses drift past the tolerance, or that has fewer steps."""
    for name, losses in (("a", [2.0, 1.9, 1.8]), ("b", [2.0, 1.9, 1.81]), ("c", [2.0, 1.9])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": {x}}}\n'
                                                                for i, x in enumerate(losses)))
    compare = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "compare", str(tmp_path / "a")]
    assert subprocess.run([*compare, str(tmp_path / "b"), "0.02"], capture_output=True).returncode == 0
    failed = subprocess.run([*compare, str(tmp_path / "b"), "0.001"], capture_output=True, text=True)
    assert failed.returncode == 1 and "parity FAILED" in failed.stdout and "1.00e-02" in failed.stdout
    assert subprocess.run([*compare, str(tmp_path / "c"), "1"], capture_output=True).returncode == 1
