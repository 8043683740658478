"""Tests for the trainer: configuration, one-line errors, gradient accumulation, the optimizer and its schedule,
metrics and plots, the NaN guard, replica hashes, and that a short run learns more than byte frequencies."""

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from minidist import precision
from minidist.comm.topology import ParallelDims
from minidist.data.corpus import BatchSampler, load_corpus, unigram_entropy_nats
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel import Layout, ParallelModel, clip_grad_norm_, placement_of
from minidist.train import loop as train
from minidist.train.config import (
    FLAGS,
    ConfigError,
    TrainConfig,
    build_parser,
    config_from_values,
    config_to_values,
    parse_config,
)
from minidist.train.optim import WarmupCosine, build_optimizer, param_groups
from minidist.train.preflight import resolve_layout
from minidist.train.reshard import read_full_model
from minidist.trust import health

SMALL_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}


def small_config(tmp_path, **changes) -> TrainConfig:
    """A run that takes a fraction of a second: 2 layers, d_model 64, batch 8 x 32, 100 kB of the stdlib corpus."""
    settings = dict(model="tiny", model_overrides=dict(SMALL_MODEL), data="stdlib", max_bytes=100_000,
                    batch_size=8, seq_len=32, steps=4, warmup_steps=2, eval_every=2, eval_batches=2, log_every=100,
                    ckpt_every=0, out=str(tmp_path / "run"), peak_flops=1e9, plot=False)
    settings.update(changes)
    return TrainConfig(**settings)


# ------------------------------------------------------------------------------------------------------------------
# configuration


def test_defaults_without_arguments():
    assert parse_config([]) == TrainConfig()


def test_toml_then_flags_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nlr = 1e-3\nbatch_size = 4\nseq_len = 16\n\n[model]\npreset = "tiny"\nn_layers = 2\n')
    cfg = parse_config(["--config", str(path), "--steps", "3", "--set", "model.d_model=64", "--set", "lr=2e-3",
                        "--dtype", "bf16", "--resume"])
    assert cfg.steps == 3  # the flag beats the file
    assert cfg.lr == 2e-3  # --set beats the file
    assert (cfg.batch_size, cfg.seq_len) == (4, 16)  # from the file
    assert cfg.model == "tiny" and cfg.model_overrides == {"n_layers": 2, "d_model": 64}
    assert cfg.dtype == "bf16" and cfg.resume is True
    assert cfg.warmup_steps == TrainConfig().warmup_steps  # neither file nor flag: the default
    assert isinstance(cfg.lr, float)


def test_config_round_trips_through_toml_values():
    cfg = TrainConfig(model="small", model_overrides={"n_layers": 2, "moe": {"n_experts": 4}}, steps=9)
    assert config_from_values(config_to_values(cfg)) == cfg


def test_help_names_every_flag():
    text = build_parser().format_help()
    for flag, _ in FLAGS:
        assert flag in text
    for flag in ("--config", "--resume", "--set", "--microbatches", "--zero", "--dtype"):
        assert flag in text


@pytest.mark.parametrize("argv, words", [
    (["--model", "nope"], "unknown model preset"),
    (["--set", "model.n_heads=3"], "does not divide d_model"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--batch-size", "10", "--microbatches", "4"], "not divisible by microbatches"),
    (["--set", "learning_rate=1"], "unknown setting"),
    (["--set", "steps='ten'"], "steps must be int"),
    (["--seq-len", "1024"], "max_seq_len"),
    (["--min-lr", "1.0"], "min_lr"),
    (["--dtype", "fp8"], "dtype"),
])
def test_config_errors_are_one_line(argv, words):
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    message = str(info.value)
    assert words in message
    assert "\n" not in message


def test_cli_config_error_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "minidist.train", "--batch-size", "10", "--microbatches", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "not divisible by microbatches" in lines[0] and "Traceback" not in proc.stderr


def test_parallel_flags_checked_against_world_size():
    # Chapter 10: cp is carved out of the world size like tp and pp.
    assert resolve_layout(TrainConfig(cp=2), world_size=4).dims == ParallelDims(dp=2, cp=2)
    cfg = TrainConfig(tp=2)
    with pytest.raises(ConfigError, match="does not fit 3 ranks"):
        resolve_layout(cfg, world_size=3)
    # Chapters 08-09: dp is what tp and pp leave of the world size.
    assert resolve_layout(TrainConfig(tp=2, pp=2), world_size=8).dims == ParallelDims(dp=2, tp=2, pp=2)
    # Chapter 07: dp defaults to the world size; the global batch must split into dp x microbatches.
    assert resolve_layout(TrainConfig(zero=3), world_size=4).dims == ParallelDims(dp=4)
    with pytest.raises(ConfigError, match=r"not divisible by dp\*microbatches = 4\*1"):
        resolve_layout(TrainConfig(batch_size=6), world_size=4)
    assert resolve_layout(TrainConfig(), world_size=1) == Layout()
    # the one record the trainer runs: the grid's degrees, how each dimension is applied, the recomputation
    assert resolve_layout(TrainConfig(zero=3), world_size=4) == Layout.of(dp=4, zero=3)
    assert resolve_layout(TrainConfig(tp=2, sp=True, microbatches=2, recompute="full"), world_size=2) == \
        Layout.of(tp=2, sequence_parallel=True, microbatches=2, recompute="full")


# ------------------------------------------------------------------------------------------------------------------
# the step


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("microbatches", [2, 4, 8])
def test_gradient_accumulation_equals_full_batch(microbatches):
    model = build_model(get_preset("tiny", **SMALL_MODEL), seed=3)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (8, 32), generator=g)
    targets = torch.randint(0, 256, (8, 32), generator=g)

    reference = lm_loss(model(inputs), targets)  # plain torch on the whole batch
    reference.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    batches = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))
    losses = ParallelModel(model, build_optimizer(model, lr=1e-3, weight_decay=0.1)).forward_backward(batches)
    assert losses.loss == pytest.approx(reference.item(), rel=1e-6)
    for got, want in zip(_grads(model), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_accumulation_normalizes_by_the_global_token_count():
    """Micro-batches with different numbers of ignored targets (padding): the accumulated gradient is still the
    gradient of the mean over every counted token of the batch, not a mean of per-micro-batch means."""
    model = build_model(get_preset("tiny", **SMALL_MODEL), seed=3)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 256, (4, 32), generator=g)
    targets = torch.randint(0, 256, (4, 32), generator=g)
    targets[0, 4:] = -100  # row 0 counts 4 tokens, the others 32
    targets[3, 20:] = -100
    reference = lm_loss(model(inputs), targets)
    reference.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    batches = list(zip(inputs.chunk(2), targets.chunk(2)))  # 36 and 52 counted tokens
    losses = ParallelModel(model, build_optimizer(model, lr=1e-3, weight_decay=0.1)).forward_backward(batches)
    assert losses.loss == pytest.approx(reference.item(), rel=1e-6)
    for got, want in zip(_grads(model), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_reports_the_norm_before_clipping():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    pieces = [(p.grad, placement_of(p)) for p in params]
    assert clip_grad_norm_(pieces, 1.0, {}) == pytest.approx(5.0)
    total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    assert total == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_(pieces, 0.0, {}) == pytest.approx(1.0, rel=1e-5)  # 0: measure only


def test_param_groups_decay_only_matrices():
    for overrides in (SMALL_MODEL, {**SMALL_MODEL, "tie_embeddings": True, "bias": True, "norm": "layernorm"}):
        model = build_model(get_preset("tiny", **overrides))
        decay, no_decay = param_groups(model, weight_decay=0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        kept = {names[id(p)] for p in no_decay["params"]}
        assert decayed | kept == set(names.values()) and not decayed & kept  # every parameter exactly once
        assert "blocks.0.attn.wq.weight" in decayed and "blocks.1.mlp.w2.weight" in decayed
        assert "tok_emb.weight" in kept and "norm.weight" in kept and "blocks.0.attn_norm.weight" in kept
        assert all(n.endswith("bias") or "norm" in n or "emb" in n for n in kept)
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_warmup_cosine_schedule():
    s = WarmupCosine(max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert s(0) == pytest.approx(0.1) and s(4) == pytest.approx(0.5) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))  # halfway through the decay
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # decays monotonically
    opt = build_optimizer(nn.Linear(2, 2), lr=1.0, weight_decay=0.0)
    assert s.apply(opt, 4) == pytest.approx(0.5) and all(g["lr"] == pytest.approx(0.5) for g in opt.param_groups)


# ------------------------------------------------------------------------------------------------------------------
# a run


def test_run_writes_metrics_run_json_and_plot(tmp_path):
    cfg = small_config(tmp_path, steps=5, eval_every=2, plot=True)
    summary = train.train(cfg)
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["grad_norm"] > 0
    schedule = WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    assert [r["lr"] for r in records] == pytest.approx([schedule(s) for s in range(5)])
    assert [r["step"] for r in records if "val_loss" in r] == [1, 3, 4]  # every 2 steps and at the end
    assert [r["loss"] for r in records] == summary["losses"]
    # MFU is throughput x causal FLOPs per token / peak: the peak we set, raised to any rate a step achieved
    info = json.loads((out / "run.json").read_text())
    peak = 1e9
    for r in records:
        achieved = r["tokens_per_s"] * info["mfu_flops_per_token"]
        peak = max(peak, achieved)
        assert r["mfu"] == pytest.approx(achieved / peak) and r["mfu"] <= 1
    corpus = load_corpus(None, cfg.val_fraction, cfg.max_bytes)
    assert info["unigram_entropy_nats"] == pytest.approx(unigram_entropy_nats(corpus.train))
    assert info["params"] == sum(p.numel() for p in build_model(get_preset("tiny", **SMALL_MODEL)).parameters())
    assert info["config"]["model"] == {"preset": "tiny", **SMALL_MODEL}
    assert info["final"]["final_loss"] == records[-1]["loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_matches_a_plain_torch_loop(tmp_path):
    """The trainer's numbers equal a loop written directly against torch: same batches, AdamW, clipping, schedule."""
    cfg = small_config(tmp_path, steps=4, warmup_steps=2, grad_clip=0.5, weight_decay=0.1, microbatches=2)
    summary = train.train(cfg)

    model = build_model(get_preset("tiny", **SMALL_MODEL), seed=cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    sampler = BatchSampler(load_corpus(None, cfg.val_fraction, cfg.max_bytes).train, cfg.seq_len, cfg.batch_size,
                           cfg.seed)
    losses, norms = [], []
    for step in range(cfg.steps):
        lr = cfg.lr * (step + 1) / 2 if step < 2 else cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (
            1 + math.cos(math.pi * (step - 2) / (cfg.steps - 2)))
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.batch(step)
        loss = lm_loss(model(inputs), targets)  # the whole batch at once: accumulation must not change the math
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert summary["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    got_norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert got_norms == pytest.approx(norms, rel=1e-4)


def test_moe_model_logs_aux_loss_and_expert_stats(tmp_path):
    moe = {"n_experts": 4, "top_k": 2, "d_expert": 64, "bias_update_speed": 0.01}
    cfg = small_config(tmp_path, model_overrides={**SMALL_MODEL, "moe": moe}, steps=3, ckpt_every=3)
    summary = train.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["aux_loss"] > 0 and r["moe_load_imbalance"] >= 1.0 for r in rows)
    assert all(math.isfinite(x) for x in summary["losses"])
    state = read_full_model(tmp_path / "run" / "checkpoints" / "step_000003")
    biases = [v for k, v in state.items() if k.endswith("router_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # the aux-loss-free update ran


def test_text_directory_as_data(tmp_path):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    summary = train.train(small_config(tmp_path, data=str(corpus), max_bytes=None, steps=2))
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])


def test_nan_guard_reports_at_the_next_read(tmp_path):
    # Logging every 4 steps: the step that diverged (index 1) is named at the read of index 3; the steps before it
    # are written, the later ones (skipped on the device) are not.
    cfg = small_config(tmp_path, lr=1e30, min_lr=0.0, warmup_steps=0, grad_clip=0.0, log_every=4, eval_every=0)
    with pytest.raises(health.TrainingDiverged, match=r"^step 2: loss="):
        train.train(cfg)
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()] == [0]


def test_step_clock_is_the_mean_over_the_synchronized_window(tmp_path, monkeypatch):
    syncs = []
    monkeypatch.setattr(train.metrics, "synchronize", lambda device: syncs.append(device))
    train.train(small_config(tmp_path, steps=5, log_every=2, eval_every=0))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(syncs) == 4  # one per read: steps 0 (the first), 1 and 3 (every 2nd), 4 (the last)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[2]["step_s"] == rows[3]["step_s"]
    assert rows[1]["step_s"] != rows[2]["step_s"] and rows[2]["mfu"] == rows[3]["mfu"]


def test_nan_guard_stops_at_the_step(tmp_path, capsys):
    # lr 1e30: step 1 is finite, its update blows the weights up, step 2's loss is not a number. The error counts
    # steps as the progress line does ("step 1/4" is the first step, index 0).
    cfg = small_config(tmp_path, lr=1e30, min_lr=0.0, warmup_steps=0, grad_clip=0.0, log_every=1)
    with pytest.raises(health.TrainingDiverged, match=r"^step 2: loss=") as info:
        train.train(cfg)
    assert "\n" not in str(info.value)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["step"] == 0  # the one step that finished
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in progress] == ["step 1/4"]  # printed; "step 2" is the one that failed


def test_nan_guard_runs_before_the_update():
    # Decided on the device: the step returns, its update skipped (optimizer state too); the guard's report comes
    # when the figures are read (`health.check_finite`, the loop's read), naming the step.
    model = build_model(get_preset("tiny", **SMALL_MODEL))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    with torch.no_grad():
        model.blocks[0].mlp.w1.weight[0, 0] = float("nan")
    before = [p.clone() for p in model.parameters()]
    batch = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))]
    losses, norm, healthy = train.train_step(ParallelModel(model, optimizer), batch, step=7, grad_clip=1.0)
    assert not healthy
    with pytest.raises(health.TrainingDiverged, match="step 8"):  # index 7 is the progress line's "step 8/..."
        health.check_finite(8, float(losses.loss), float(norm))
    # no update happened: the state is what a fused AdamW leaves after a step skipped by found_inf (zeros)
    assert all(not torch.is_nonzero(t.abs().sum()) for s in optimizer.state.values() for t in s.values())
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.nan_to_num(), q.nan_to_num())
    with pytest.raises(health.TrainingDiverged, match="grad_norm=inf"):
        health.check_finite(3, 1.0, float("inf"))


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_stays_skipped_until_the_read(fused):
    # After a non-finite step, finite ones change nothing either (the weights stay those before the first bad
    # step, AdamW's moments and step counts included), with torch's found_inf (fused) or the copy (elsewhere).
    model = build_model(get_preset("tiny", **SMALL_MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    parallel = ParallelModel(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 256, (2, 8), generator=gen), torch.randint(0, 256, (2, 8), generator=gen))]
    _, _, healthy = train.train_step(parallel, batch, step=0, grad_clip=1.0)
    assert healthy
    state = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
    weights = [p.clone() for p in model.parameters()]
    bad = [(batch[0][0], torch.full_like(batch[0][1], -100))]  # no counted target: loss 0/0 = NaN
    _, _, healthy = train.train_step(parallel, bad, step=1, grad_clip=1.0, healthy=healthy)
    _, _, healthy = train.train_step(parallel, batch, step=2, grad_clip=1.0, healthy=healthy)  # finite, skipped
    assert not healthy
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), weights))
    assert all(torch.equal(v, state[k]) for k, v in optimizer.state[next(model.parameters())].items())


def test_replica_hash_is_exact():
    a = [torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), torch.arange(3.0)]
    b = [t.clone() for t in a]
    assert health.replica_hash(a) == health.replica_hash(b)
    b[0][2, 3] = torch.nextafter(b[0][2, 3], torch.tensor(math.inf))  # one ulp
    assert health.replica_hash(a) != health.replica_hash(b)
    assert health.replica_hash([a[1]]) != health.replica_hash([a[1].reshape(1, 3)])  # shape counts
    assert health.replica_hash([a[1]]) != health.replica_hash([a[1].double()])  # dtype counts
    assert health.replica_hash([a[1].bfloat16()]) == health.replica_hash([a[1].bfloat16().clone()])


def test_bf16_autocast_runs_with_fp32_losses(tmp_path):
    summary = train.train(small_config(tmp_path, dtype="bf16", steps=2))
    assert all(math.isfinite(x) for x in summary["losses"])
    with pytest.raises(TypeError, match="float32"):
        precision.check_fp32("loss", torch.zeros((), dtype=torch.bfloat16))


def test_short_run_beats_unigram_entropy(tmp_path):
    # 80 steps of 16 x 64 bytes: 82k tokens, a tenth of the 0.9 MB training split (no memorizing).
    cfg = small_config(tmp_path, max_bytes=1_000_000, batch_size=16, seq_len=64, steps=80, warmup_steps=10,
                       eval_every=0, eval_batches=4)
    summary = train.train(cfg)
    entropy = summary["unigram_entropy_nats"]
    assert summary["losses"][0] == pytest.approx(math.log(256), abs=0.1)  # small init: ~uniform predictions
    assert sum(summary["losses"][-10:]) / 10 < entropy - 0.3
    assert summary["final_val_loss"] < entropy - 0.1
