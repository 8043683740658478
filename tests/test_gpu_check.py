"""scripts/gpu_check.sh, the one prepared check for a GPU machine: its CPU path runs here so it cannot rot; the GPU
configs it and the README use parse and pass the layout checks for their GPU counts."""

import os
import re
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
    for name in ("probes", "parity", "throughput", "layouts"):  # each step's time against its budget
        assert re.search(rf"step {name}: \d+ s of \d+ s", out), name
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


def _plan(*args: str) -> tuple[dict[str, int], str]:
    """The script's plan (--dry-run): each step's budget in seconds, and the commands it would run."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", "/nonexistent/plan",
                             *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    budgets = {m.group(1): int(m.group(2)) for m in re.finditer(r"^== step (\S+) \(budget (\d+) s\)", result.stdout,
                                                                 re.MULTILINE)}
    return budgets, result.stdout


def test_the_script_parses_and_refuses_bad_flags():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    for bad in (["--device", "tpu"], ["--frobnicate"], ["--gpus", "two", "--dry-run"], ["--gpus", "2"], ["--out"]):
        result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *bad], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (bad, result.stderr)


def test_one_gpu_plan_fits_eight_minutes_and_compiles():
    """One GPU: probes, parity and throughput, budgeted within 480 s (the script fails a run past it); a compiled
    parity run and a compiled 1B run; no layouts; --install installs the runtime dependencies only."""
    budgets, plan = _plan("--gpus", "1", "--install")
    assert set(budgets) == {"install", "probes", "parity", "throughput"}, budgets
    assert budgets["probes"] + budgets["parity"] + budgets["throughput"] <= 480
    assert "layouts: skipped (1 GPU(s)" in plan and "torch.distributed.run" not in plan
    assert re.search(r"train .*--compile .*--out /nonexistent/plan/tiny-compiled ", plan)
    assert re.search(r"dense-1b.toml .*--compile --device cuda", plan)
    install = [line for line in plan.splitlines() if "pip install" in line]
    assert len(install) == 1 and " -e . " in install[0] and "[" not in install[0], install


@pytest.mark.parametrize("gpus", [2, 4])
def test_multi_gpu_plan_runs_the_compiled_matrix(gpus):
    """2+ GPUs: the NCCL probe on one process per GPU; the compiled matrix (dp2 ZeRO-3, tp2 sp, pp2 zbv, cp2 ring,
    ep2 MoE) on 2 processes with --compile, each against its one-device run; with 4, two 4-process layouts too."""
    budgets, plan = _plan("--gpus", str(gpus))
    assert "layouts" in budgets
    assert f"--nproc_per_node={gpus} scripts/gpu_check.py comm cuda" in plan
    launches = [line for line in plan.splitlines() if "would run: launch" in line]
    compiled = [line for line in launches if " --compile " in line]
    for flags in ("--dp 2 --zero 3", "--tp 2 --sp", "--pp 2 --schedule zbv", "--cp 2 --cp-impl ring", "--ep 2"):
        assert any(flags in line and "launch 2 " in line for line in compiled), flags
    assert sum("launch 4 " in line for line in compiled) == (2 if gpus >= 4 else 0)
    for name in ("dp2-zero3", "tp2-sp", "pp2-zbv", "cp2-ring", "ep2"):
        assert re.search(rf"compare /nonexistent/plan/tiny-(device|moe) /nonexistent/plan/tiny-{name}-compiled ",
                         plan), name
