"""Mixed precision: --dtype auto resolves by device, bf16 computes in bf16 while weights, gradients, optimizer state
and reductions stay fp32, and a bf16 dp2 run matches the bf16 one-process run (parity, within bf16's tolerance)."""

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minidist import precision
from minidist.comm.launch import run_ranks
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel import ParallelModel
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.optim import build_optimizer

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}
# bf16 keeps 8 significant bits: one rounding is up to 2^-9 = 0.2% relative. A dp2 run rounds different partial
# sums (each rank's half batch, then an fp32 average) than one process does, so losses agree to bf16 roundings,
# not bitwise. Measured on this case: 2.4e-4 between dp2 and one process (bf16 vs fp32: 4.4e-4). The tolerance,
# 2e-3 on losses near 5 (0.04%), is 8x the measured gap and far below what a wrong reduction would give (a sum
# instead of a mean over 2 ranks doubles the update).
BF16_LOSS_ATOL = 2e-3


def config(out: str, **changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=100_000, batch_size=8, seq_len=32,
                    steps=4, warmup_steps=1, eval_every=0, eval_batches=2, log_every=100, ckpt_every=0,
                    check_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    assert precision.resolve_dtype("auto", torch.device("cpu")) == "fp32"
    assert precision.resolve_dtype("auto", torch.device("cuda", 0)) == "bf16"
    assert precision.resolve_dtype("fp32", torch.device("cuda", 0)) == "fp32"
    assert TrainConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype 'fp16' is unknown") as info:
        check_config(TrainConfig(dtype="fp16"))
    assert "\n" not in str(info.value)


def test_tf32_is_set_only_for_cuda_and_both_precision_apis_answer():
    """TF32 on CUDA through torch.set_float32_matmul_precision: the legacy getter inductor calls still answers
    (setting only the per-backend switches makes it raise), and the CPU's oneDNN matmuls stay exact fp32."""
    backends = torch.backends
    switches = (backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn, backends.mkldnn.matmul)
    before = torch.get_float32_matmul_precision(), [s.fp32_precision for s in switches]
    a, b = torch.randn(64, 96, dtype=torch.float64), torch.randn(96, 48, dtype=torch.float64)
    exact = (a.float() @ b.float()).double()
    try:
        torch.set_float32_matmul_precision("highest")
        precision.configure_matmuls(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        assert (backends.cuda.matmul.fp32_precision, backends.mkldnn.matmul.fp32_precision) == ("ieee", "ieee")
        precision.configure_matmuls(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        assert (backends.cuda.matmul.fp32_precision, backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
        assert backends.mkldnn.matmul.fp32_precision == "ieee"  # the CPU's, as it was
        assert torch.equal((a.float() @ b.float()).double(), exact)
        assert ((exact - a @ b).abs().max() / (a @ b).abs().max()) < 1e-6  # fp32, not a 10-bit-mantissa product
    finally:
        torch.set_float32_matmul_precision(before[0])
        for switch, value in zip(switches, before[1]):
            switch.fp32_precision = value


def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights_and_state():
    cfg = get_preset("tiny", **MODEL)
    model = build_model(cfg)
    parallel = ParallelModel(model, build_optimizer(model, lr=1e-3, weight_decay=0.1))
    autocast = precision.autocast_for("bf16", torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with autocast():
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16
    assert lm_loss(logits, tokens).dtype == torch.float32
    parallel.forward_backward([(tokens, tokens)], autocast)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    parallel.step()
    for p in model.parameters():
        state = parallel.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def _dp2_bf16(root: str) -> list[float]:
    out = str(Path(root) / "dp2")
    summary = train.train(config(out, dp=2, dtype="bf16"))
    dist.barrier()
    return summary["losses"]


@functools.lru_cache(maxsize=1)
def _runs(root: str) -> dict:
    dp2 = run_ranks(_dp2_bf16, 2, root, timeout=300, threads_per_rank=1)
    one = train.train(config(str(Path(root) / "one_bf16"), dtype="bf16"))
    fp32 = train.train(config(str(Path(root) / "one_fp32"), dtype="fp32"))
    return {"dp2": dp2, "one": one, "fp32": fp32, "root": root}


def test_bf16_dp2_matches_bf16_one_process(tmp_path_factory):
    runs = _runs(str(tmp_path_factory.mktemp("bf16")))
    one, fp32 = runs["one"]["losses"], runs["fp32"]["losses"]
    for rank_losses in runs["dp2"]:
        assert rank_losses == pytest.approx(one, abs=BF16_LOSS_ATOL)
    # bf16 is really on: the bf16 run differs from fp32 by more than fp32 rounding would explain.
    assert max(abs(a - b) for a, b in zip(one, fp32)) > 1e-4
    info = json.loads((Path(runs["root"]) / "dp2" / "run.json").read_text())
    assert info["dtype"] == "bf16" and info["config"]["dtype"] == "bf16"
