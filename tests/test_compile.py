"""--compile (minidist.train.blocks): a one-process run with every block compiled by inductor logs the same losses
and gradient norms as the eager run within fp32 rounding, and the compiled code really ran (dynamo's counters); without
a C++ compiler, --compile on a CPU is refused in one line, never run eagerly in silence."""

import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from minidist.model import build_model, get_preset
from minidist.train import loop as train
from minidist.train.blocks import compile_blocks
from minidist.train.config import ConfigError, parse_config
from tests.test_train import small_config


def compiled_blocks(model) -> int:
    """How many of `model.blocks` go through compiled code (their forward is torch.compile's wrapper)."""
    return sum(hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable") for block in model.blocks)


def test_compiled_run_logs_the_eager_run(tmp_path):
    # 2 steps, no validation split (an evaluation would compile a third, no-grad graph): ~1 compile of one block's
    # forward and backward, reused by the other block.
    settings = dict(steps=2, batch_size=4, val_fraction=0.0, warmup_steps=1)
    eager = train.train(small_config(tmp_path / "eager", **settings))
    torch._dynamo.reset()
    counters.clear()
    compiled = train.train(small_config(tmp_path / "compiled", compile=True, **settings))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # dynamo captured and compiled
    assert counters["inductor"], "inductor compiled nothing"  # the backend really was inductor
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    logs = [(tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines() for run in ("eager", "compiled")]
    norms = [[json.loads(line)["grad_norm"] for line in log] for log in logs]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_compile_blocks_keeps_names_and_marks_every_block():
    cfg = get_preset("tiny", n_layers=3)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    compile_blocks(model)
    assert compiled_blocks(model) == 3
    assert [n for n, _ in model.named_parameters()] == names


def test_compile_without_a_cpp_compiler_is_one_line(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        parse_config(["--compile", "--device", "cpu"])
    for backend in ("aot_eager", "eager"):  # no code generation: no compiler asked for
        assert parse_config(["--compile", "--device", "cpu", "--compile-backend", backend]).compile_backend == backend


@pytest.mark.parametrize("argv, match", [
    (["--compile-backend", "cudagraphs"], "compile_backend 'cudagraphs' is unknown"),
    (["--expert-backend", "triton"], "expert_backend 'triton' is unknown"),
    (["--compile", "--compile-backend", "aot_eager", "--expert-backend", "grouped_mm"],
     "grouped_mm with --compile needs --dtype bf16"),
    # eager too (main 7df2745): "Trying to backward an extra time ... selective activation checkpoint" on rank 1
    (["--recompute", "selective", "--pp", "2", "--schedule", "zbv", "--microbatches", "4", "--batch-size", "8"],
     "selective with --schedule zbv: W reads"),
])
def test_compile_settings_are_refused_in_one_line(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_config([*argv, "--device", "cpu"])
    parse_config(["--compile", "--compile-backend", "aot_eager", "--expert-backend", "grouped_mm", "--dtype",
                  "bf16", "--device", "cpu"])  # bf16: CUDA's rule holds


@pytest.mark.parametrize("argv, setting", [([], None), (["--compile"], True), (["--no-compile"], False),
                                           (["--set", "compile=false"], False)])
def test_compile_is_three_valued_and_resolved_by_device(argv, setting, monkeypatch):
    import importlib.util

    from minidist.train.blocks import resolve_compile

    assert parse_config([*argv, "--device", "cuda"]).compile is setting  # cuda: no C++ compiler asked for
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else
                        real_find_spec(name, *a))
    # The default: compiled on CUDA (the fusion a GPU needs), eager on a CPU (tests, notebooks, CI unchanged).
    expected = {cpu: bool(setting), cuda: setting is not False}
    assert {device: resolve_compile(setting, device) for device in (cpu, cuda)} == expected
    # a CUDA torch without Triton: inductor has no GPU code generator
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else
                        real_find_spec(name, *a))
    assert resolve_compile(setting, cuda) == bool(setting)


def _compiled_nodes(root) -> list:
    """The compiled graphs' autograd nodes (AOTAutograd's, one per graph) reachable from `root`."""
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            found.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return found


@pytest.mark.parametrize("gemms_eager", [True, False])
def test_zero_bubble_split_under_compile_runs_each_graph_once(gemms_eager):
    """B and W of a compiled chunk: every compiled graph's backward runs once (in B), none again in W (no
    donated-buffer error under retain_graph either), and B + W give the fused backward's gradients bit for bit.
    With the GEMMs outside the graphs (the trainer's choice under a zero-bubble schedule) W computes every
    linear's weight gradient: none exists after B."""
    from minidist.parallel.pp.split_backward import backward_input, backward_weight
    from minidist.train.blocks import keep_gemms_eager

    torch._dynamo.reset()
    model = build_model(get_preset("tiny", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64), seed=0)
    compile_blocks(model, "aot_eager")
    if gemms_eager:
        keep_gemms_eager(model)
    params = [p for block in model.blocks for p in block.parameters()]
    x, dy = torch.randn(2, 16, 32), torch.randn(2, 16, 32)

    def forward():
        leaf = x.clone().requires_grad_()
        return leaf, model(leaf, embed=False, head=False)

    leaf, y = forward()
    torch.autograd.backward([y], [dy])
    fused = [p.grad.clone() for p in params] + [leaf.grad]
    model.zero_grad(set_to_none=True)
    leaf, y = forward()
    runs = {"B": 0, "W": 0}
    phase = ["B"]
    nodes = _compiled_nodes(y.grad_fn)
    assert nodes  # the blocks run through compiled graphs
    for node in nodes:
        node.register_hook(lambda *_: runs.__setitem__(phase[0], runs[phase[0]] + 1))
    (dx,), work = backward_input([y], [dy], [leaf])
    linears = [m.weight for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert all(w.grad is None for w in linears)  # B computed no weight gradient into .grad
    phase[0] = "W"
    backward_weight(work)
    assert runs == {"B": len(nodes), "W": 0}
    assert all(torch.equal(g, f) for g, f in zip([p.grad for p in params] + [dx], fused))
