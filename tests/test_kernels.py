"""Chapter 19's Triton FlashAttention-2 (minidist/kernels/), forward and backward, under Triton's interpreter on
this CPU: equal to chapter 10's einsum reference and to SDPA (causal and not, MHA / GQA / MQA, MLA's 24/16 head
sizes padded into 32/16 tiles, document masks), every sequence with a partial last tile; the tiles the masks hide
are never visited; bad shapes are refused in one line.

The interpreter is chosen when Triton decorates a kernel, from TRITON_INTERPRET in the environment: it is set for
one child process (`tests/kernel_cases.py`), never in this one, where it would change every later Triton import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minidist import kernels

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5  # fp32, relative to the largest reference value: block-by-block sums in another order


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "found.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_cases.py"), str(out)], env=env, check=True,
                   timeout=600)
    return json.loads(out.read_text())


def test_the_child_ran_the_kernels_interpreted(found):
    assert found["interpreted"] is True


@pytest.mark.parametrize("case", ["causal mha", "causal gqa", "causal mqa", "full gqa", "mla heads 24/16",
                                  "documents gqa"])
def test_forward_and_gradients_equal_the_references(found, case):
    figures = found["cases"][case]
    tol = TOL * max(1.0, figures["scale"])
    assert figures["out"] < tol and figures["lse"] < tol, f"{case}: forward vs einsum {figures}"
    assert figures["sdpa_out"] < tol, f"{case}: forward vs SDPA {figures}"
    for name, diff, sdpa in zip("qkv", figures["grads"], figures["sdpa_grads"]):
        assert diff < tol and sdpa < tol, f"{case}: d{name} vs einsum {diff:.2e}, vs SDPA {sdpa:.2e}"


def test_fp16_inputs(found):
    """The GPU path's casts (P and dS down to the input dtype for the matmuls, fp32 accumulators), in fp16: within
    fp16's rounding of the reference (bf16 cannot run under the interpreter: kernel_cases.half_precision)."""
    fp16 = found["fp16"]
    assert fp16["dtypes"] == ["torch.float16"] * 4
    assert fp16["out"] < 2e-3 and max(fp16["grads"]) < 4e-3, fp16  # measured: 2e-4 and 5e-4


def test_masked_tiles_are_skipped(found):
    skipped = found["skipped"]
    assert skipped["documents: tile 0 does reach its own queries"], "the poison is there: the check can fail"
    assert skipped["documents: last query tile finite"] and skipped["documents: last query tile equal"] < TOL
    assert skipped["causal: first three query tiles finite"]
    assert skipped["documents: dk, dv of key tiles 0-1 finite"]


def test_bad_shapes_are_refused_in_one_line(found):
    for name, message in found["refusals"].items():
        assert message and "\n" not in message, f"{name}: {message!r}"
    assert "sdpa" in found["refusals"]["head 300"]


def test_without_the_interpreter_a_cpu_run_is_refused(monkeypatch):
    """This process never set TRITON_INTERPRET (the kernels are not imported here, or were compiled for a GPU):
    a CPU run is refused with a line that says how to start one."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.interpreted(), "the kernels were imported under the interpreter into the test process"
    why = kernels.unavailable("cpu")
    assert why and "TRITON_INTERPRET=1" in why and "\n" not in why


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kernel_trainer")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_trainer.py"), str(root)], env=env, check=True,
                   timeout=600)
    return json.loads((root / "found.json").read_text())


@pytest.mark.parametrize("docs", ["plain", "docs"])
def test_the_trainer_with_the_triton_kernel_logs_the_sdpa_losses(trained, docs):
    sdpa, triton = trained["runs"][f"sdpa {docs}"], trained["runs"][f"triton {docs}"]
    for key in ("losses", "val", "grad_norms"):
        assert len(triton[key]) == len(sdpa[key]) > 0, key
        for step, (a, b) in enumerate(zip(triton[key], sdpa[key])):
            assert abs(a - b) <= 1e-4 * abs(b), f"--doc-mask {docs == 'docs'}: {key}[{step}] triton {a} sdpa {b}"
    assert trained["runs"]["sdpa plain"]["losses"] != trained["runs"]["sdpa docs"]["losses"]  # the mask matters


def test_the_trainer_ran_the_kernel(trained):
    """Twice (plain and --doc-mask), 2 blocks: 2 steps of 2 micro-batches forward and backward, and 1 evaluation
    (at the end) of 1 batch in 2 micro-batches forward."""
    assert len(trained["runs"]["triton plain"]["val"]) == 1
    assert trained["calls"] == {"forward": 2 * 2 * (2 * 2 + 1 * 2), "backward": 2 * 2 * 2 * 2}


def test_the_trainer_refuses_the_kernel_with_cp_and_without_the_interpreter(monkeypatch):
    from minidist.train.config import ConfigError, check_config
    from minidist.train.preflight import check_attention_kernel
    from minidist.train.settings import TrainConfig

    with pytest.raises(ConfigError, match="--cp > 1"):
        check_config(TrainConfig(attention_kernel="triton", cp=2, seq_len=64))
    with pytest.raises(ConfigError, match="unknown"):
        check_config(TrainConfig(attention_kernel="flash"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.interpreted()
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        check_attention_kernel("triton", torch.device("cpu"))
    check_attention_kernel("sdpa", torch.device("cpu"))  # SDPA needs nothing


def test_the_benchmark_says_a_cpu_measures_nothing(monkeypatch, capsys):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench/attention.py"])
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "bench" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main()
    assert "measures nothing" in capsys.readouterr().out


def test_the_kernels_import_torch_and_triton_only():
    """minidist/kernels/ sits at the bottom of the import direction: beside the standard library, torch, triton
    and its own modules, nothing (not comm/, its neighbour in the layer)."""
    import ast

    allowed = {"torch", "triton", "minidist.kernels", "__future__"} | set(sys.stdlib_module_names)
    found = set()
    for path in sorted((ROOT / "minidist" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found |= {(path.name, name) for name in names}
    outside = sorted((file, name) for file, name in found
                     if not any(name == ok or name.startswith(ok + ".") for ok in allowed))
    assert not outside, outside
    assert {name.split(".")[0] for _, name in found} >= {"torch", "triton"}
