"""The single-device reference that every parallel layout must reproduce (parity is the law: docs/ARCHITECTURE.md).

One model, seed, data order and optimizer. A parallel test runs the same steps under its layout and compares:
the loss of every step (the mean over the whole global batch) and the full gradient of the first step (gathered
from shards, keyed by parameter name), within fp32 tolerance. Gradient clipping is on and active, so a wrong
global norm across shards (double-counted replicas, missing shards) shows up as a loss mismatch. Clipping and
Adam both hide a uniformly mis-scaled gradient (e.g. a missing 1/micro-batches factor) from the losses; the
first-step gradients, compared before clipping, catch it.

Rank processes import this module too (tests/ is on their sys.path), so keep it free of pytest.
"""

from __future__ import annotations

import functools

import torch

from minidist.data.corpus import BatchSampler, load_corpus
from minidist.debug import grad_diff, tolerance
from minidist.model import ModelConfig, build_model, get_preset, lm_loss

# Every layout of the course divides these: 4 heads, 2 KV heads, 4 layers, vocab 256, batch 8, seq 32.
CFG: ModelConfig = get_preset("tiny", d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
SEQ_LEN = 32
GLOBAL_BATCH = 8
STEPS = 3
SEED = 1234
LR = 3e-3
GRAD_CLIP = 0.5  # below the first steps' gradient norm (~2.5), so clipping is exercised
# Closeness is chapter 14's rule (minidist.debug.tolerance): what reduction order alone explains, 1.3e-6 relative per
# step in fp32. assert_losses_match uses it per step (tighter than the rtol 1e-5 + atol 1e-5 it replaced).
LOSS_RTOL = tolerance.rel_tol("fp32", STEPS)  # for callers comparing figures of a whole run
LOSS_ATOL = 1e-5  # only for figures near zero (MoE balance losses), where a relative bound means nothing
GRAD_TOL = tolerance.rel_tol("fp32", 1)  # per parameter, ||got - want|| / ||want|| after one backward
# Kept beside the rule: an element-wise bound, tighter than the rule's norm-wise one for a single element near zero
# in a tensor of norm > 0.75 (the rule alone would let such one element drift by up to 1.3e-6·||want||).
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@functools.lru_cache(maxsize=1)
def _tokens() -> torch.Tensor:
    return load_corpus(max_bytes=300_000).train


def global_batch(step: int, global_batch_size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [global_batch, SEQ_LEN] of `step`, the same on every rank and every layout."""
    return BatchSampler(_tokens(), SEQ_LEN, global_batch_size, SEED).batch(step)


def make_optimizer(params) -> torch.optim.Optimizer:
    """The reference optimizer; a sharded optimizer must implement exactly this update."""
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


@functools.lru_cache(maxsize=4)
def reference_run(cfg: ModelConfig = CFG, steps: int = STEPS, global_batch_size: int = GLOBAL_BATCH) -> dict:
    """Train on one device; return {"losses": [...], "grad_norms": [...], "grads": first step's grads by name}.

    `global_batch_size` other than GLOBAL_BATCH is for layouts it does not divide (e.g. 3 micro-batches)."""
    model = build_model(cfg, seed=SEED)
    optimizer = make_optimizer(model.parameters())
    losses, grad_norms, first_grads = [], [], {}
    for step in range(steps):
        inputs, targets = global_batch(step, global_batch_size)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if step == 0:
            first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": grad_norms, "grads": first_grads}


def assert_losses_match(losses: list[float], reference: list[float], label: str) -> None:
    if len(losses) != len(reference) or not tolerance.close(losses, reference):  # loss i after i + 1 steps
        raise AssertionError(f"{label}: losses {losses} differ from the single-device run {reference}")


def assert_norms_match(norms: list[float], reference: list[float], label: str) -> None:
    """The global gradient norm of every step (before clipping), by the same per-step rule as the losses."""
    if len(norms) != len(reference) or not tolerance.close(norms, reference):
        raise AssertionError(f"{label}: gradient norms {norms} differ from the single-device run's {reference}")


def assert_grads_match(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], label: str) -> None:
    missing = sorted(set(reference) - set(grads))
    extra = sorted(set(grads) - set(reference))
    if missing or extra:
        raise AssertionError(f"{label}: gradient names differ: missing {missing}, unexpected {extra}")
    for name, want in reference.items():
        got = grads[name]
        if got.shape != want.shape:
            raise AssertionError(f"{label}: {name} gradient has shape {tuple(got.shape)}, want {tuple(want.shape)}")
        if not torch.allclose(got.float(), want, rtol=GRAD_RTOL, atol=GRAD_ATOL):
            err = (got.float() - want).abs().max().item()
            raise AssertionError(f"{label}: {name} gradient differs from the single-device one (max |diff| {err:.2e})")
    report = grad_diff.diff({name: grads[name].float() for name in reference}, reference, GRAD_TOL)
    if not report.ok:
        raise AssertionError(f"{label}: gradients differ from the single-device ones by more than reduction order "
                             f"explains (rule {GRAD_TOL:.1e}): {report.summary()}")
