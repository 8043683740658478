"""Parameter counts, FLOPs per token, and MFU against the peak FLOP/s it divides by (chapter 01).

Conventions, because published numbers differ mostly by what they choose to count:

* A matmul of an [m, k] by a [k, n] matrix costs 2·m·n·k FLOPs (one multiply and one add per term).
* A linear layer with a [k, n] weight costs 2·k·n FLOPs per token forward and 4·k·n backward (one matmul for the
  input gradient, one for the weight gradient), so training costs 6 FLOPs per matmul parameter per token.
* `flops_per_token` is PaLM's convention (Chowdhery et al. 2022, Appendix B): 6·N + 12·L·H·Q·T, where N counts
  the parameters that multiply every token (attention and MLP weights and the output projection; not the input
  embedding, which is a table lookup, nor norms and biases, which are not matmuls) and the attention term is the
  full T×T score and value matmuls, as a kernel computes them when it does not skip the masked half. That is what
  `torch.utils.flop_counter.FlopCounterMode` counts on our model, exactly (notebook 01, tests/test_flops.py).
* `kaplan_flops_per_token` is Kaplan et al. 2020, Table 1: C ≈ 6·N + 6·L·T·d_attn with N the non-embedding
  parameters: half of PaLM's attention term (causal), and no output projection.
* `training_flops` is C = 6·N·D (Kaplan et al. 2020, §2.1), the number the scaling-law papers quote.

Elementwise work (norms, activations, softmax, residual adds, the optimizer) is left out by every convention: it
is O(d) per token against O(d²) for the matmuls.

The peak FLOP/s that MFU divides by, where it comes from, and an MFU that cannot pass 100%:

* A known GPU: the datasheet's dense bf16 figure (`minidist.hardware.CHIPS`, sources there), matched on the name
  CUDA reports.
* A CPU or an unknown GPU: measured. One matmul timed a few times is a poor ceiling (a 1024³ matmul runs ~0.15 s,
  its best shape is not the model's, and a busy machine at start-up measures low, which gave MFU 115% on a CPU).
  `measure_matmul_peak` times several shapes, the model's own among them, for at least `min_seconds` in all, and
  keeps the best rate: on CUDA with CUDA events, on a CPU with the wall clock.
* A measured peak is still a sample. `MfuMeter` raises it to any rate a step achieved (and says so once), so MFU
  stays at most 1, and keeps the cumulative figure: total model FLOPs over total step time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from minidist.hardware import datasheet_chip, peak_flops
from minidist.model.config import ModelConfig

MFU_CONVENTION = ("model FLOPs per token = 6*N (matmul parameters incl. the output head, not the input "
                  "embedding) + causal attention (T+1)/2 unmasked pairs per token, fwd+bwd; no recomputation")

# ------------------------------------------------------------------------------------------------------------------
# parameter counts, by component


def _norm(cfg: ModelConfig, dim: int) -> int:
    # RMSNorm has a gain; LayerNorm a gain and, when the model uses biases, a bias.
    return dim * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases + norm gains) of one attention layer."""
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention == "mla":
        # No biases (absorption folds the matrices into each other); q_norm and kv_norm are RMSNorms.
        m = cfg.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            shapes = [(d, h * qk_dim)]
            gains = 0
        else:
            shapes = [(d, m.q_lora_rank), (m.q_lora_rank, h * qk_dim)]
            gains = m.q_lora_rank
        shapes += [(d, m.kv_lora_rank + m.qk_rope_head_dim), (m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim)),
                   (h * m.v_head_dim, d)]
        return sum(i * o for i, o in shapes), gains + m.kv_lora_rank
    q, kv = h * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    biases = (q + 2 * kv + d) if cfg.bias else 0
    return 2 * d * q + 2 * d * kv, biases


def _dense_mlp(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases) of one dense feed-forward layer."""
    d, f = cfg.d_model, cfg.d_ff
    if cfg.mlp == "gelu":
        return 2 * d * f, (f + d if cfg.bias else 0)
    return 3 * d * f, (2 * f + d if cfg.bias else 0)


def _moe_mlp(cfg: ModelConfig, active_only: bool) -> int:
    """Matmul weights of one MoE layer: router (d × E), routed SwiGLU experts (3·d·d_expert each), shared experts.

    All of them, or, with active_only, the top_k experts a token is routed to plus the shared ones. No biases.
    """
    m, d = cfg.moe, cfg.d_model
    d_expert = m.d_expert or cfg.d_ff
    routed = m.top_k if active_only else m.n_experts
    return d * m.n_experts + 3 * d * d_expert * (routed + m.n_shared_experts)


def _is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe.n_experts > 0 and layer >= cfg.moe.first_dense_layers


def param_breakdown(cfg: ModelConfig, active_only: bool = False) -> dict[str, int]:
    """Parameter counts by component: embedding, position, attention, mlp, norms_and_biases, lm_head.

    "lm_head" is 0 when the output projection is tied to the embedding (its parameters are the embedding's).
    """
    attn_w, attn_extra = _attention_weights(cfg)
    mlp_w = mlp_extra = 0
    for layer in range(cfg.n_layers):
        if _is_moe_layer(cfg, layer):
            mlp_w += _moe_mlp(cfg, active_only)
        else:
            w, extra = _dense_mlp(cfg)
            mlp_w += w
            mlp_extra += extra
    norms = (2 * cfg.n_layers + 1) * _norm(cfg, cfg.d_model)
    return {
        "embedding": cfg.vocab_size * cfg.d_model,
        "position": cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0,
        "attention": cfg.n_layers * attn_w,
        "mlp": mlp_w,
        "norms_and_biases": norms + cfg.n_layers * attn_extra + mlp_extra,
        "lm_head": 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size,
    }


def count_params(cfg: ModelConfig, include_embeddings: bool = True, active_only: bool = False) -> int:
    """Number of parameters of `Transformer(cfg)`, from the config alone (equals sum(p.numel()) of a built model).

    include_embeddings=False gives Kaplan's "non-embedding" count: without the token and position embeddings and
    without an untied output projection (the de-embedding). active_only=True counts, for a mixture of experts,
    only the experts one token uses (top_k routed + shared) and the router; for dense models it changes nothing.

    MoE layers are counted as: router = Linear(d_model, n_experts, no bias), every expert (routed or shared) a
    SwiGLU with hidden size d_expert (default d_ff) and no biases, the first `first_dense_layers` blocks dense.
    MLA: wq (or wq_a d→q_lora_rank, q_norm, wq_b q_lora_rank→H·(nope+rope)), wkv_a d→kv_lora_rank+rope,
    kv_norm, wkv_b kv_lora_rank→H·(nope+v), wo H·v→d, no biases, RMSNorm gains. These match minidist.model.moe
    and minidist.model.mla (tests/test_flops.py compares them with built models).
    """
    parts = param_breakdown(cfg, active_only)
    if not include_embeddings:
        parts["embedding"] = parts["position"] = parts["lm_head"] = 0
    return sum(parts.values())


def matmul_params(cfg: ModelConfig, active_only: bool = True) -> int:
    """The N of "6·N": weights that multiply every token (attention, MLP or active experts, router, output head).

    Excludes the input embeddings (a lookup, no arithmetic), norms and biases (elementwise). With tied embeddings
    the output projection still costs a d×V matmul per token, so it is included either way.
    """
    parts = param_breakdown(cfg, active_only)
    return parts["attention"] + parts["mlp"] + cfg.d_model * cfg.vocab_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs (forward + backward) per token of the score (q·kᵀ) and value (p·v) matmuls of all layers.

    Forward per layer and token: 2·T·H·d_qk for the scores and 2·T·H·d_v for the values; ×3 for training. For
    GQA/MHA (d_qk = d_v = Q) that is PaLM's 12·L·H·Q·T. causal=True halves it: a kernel that skips the masked
    upper triangle does about half the work (Kaplan et al.'s 2·L·T·d_attn forward term is this causal count).
    """
    if cfg.attention == "mla":
        d_qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
        d_v = cfg.mla.v_head_dim
    else:
        d_qk = d_v = cfg.head_dim
    full = 6 * cfg.n_layers * seq_len * cfg.n_heads * (d_qk + d_v)
    return full / 2 if causal else float(full)


def causal_attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the score and value matmuls that a causal kernel really does (flash attention
    skips the masked tiles): query i meets keys 0..i, so a sequence of T tokens holds T·(T+1)/2 unmasked pairs,
    (T+1)/2 per token where the full count has T. Exact for a kernel that skips every masked entry; a tiled kernel
    computes the diagonal tiles whole, a little more (so MFU by this count is, if anything, an under-estimate).
    """
    return attention_flops_per_token(cfg, seq_len) * (seq_len + 1) / (2 * seq_len)


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int, active_only: bool = True) -> float:
    """The model FLOPs per token that MFU counts in minidist: 6·N + the causal attention term
    (`causal_attention_flops_per_token`). PaLM's `flops_per_token` counts the full T×T attention, the work of a
    kernel that does not skip the masked half; our attention kernels are causal, and a utilization must not credit
    work the hardware never did."""
    return 6.0 * matmul_params(cfg, active_only) + causal_attention_flops_per_token(cfg, seq_len)


def step_flops(cfg: ModelConfig, tokens: int, pairs: int, active_only: bool = True) -> float:
    """The model FLOPs MFU counts for `tokens` tokens whose attention scored `pairs` (query, key) pairs: 6·N per
    token + the score and value matmuls per pair kept (`attention_flops_per_token(cfg, 1)`). A document mask keeps
    Σ_documents l·(l+1)/2 pairs per row (`minidist.model.documents.attention_pairs`); the causal mask T·(T+1)/2,
    where this equals tokens · `mfu_flops_per_token`."""
    return 6.0 * matmul_params(cfg, active_only) * tokens + attention_flops_per_token(cfg, 1) * pairs


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False, active_only: bool = True) -> float:
    """Training (forward + backward) FLOPs per token, PaLM's convention: 6·N + 12·L·H·Q·T.

    N = `matmul_params` (the output projection included, input embeddings excluded); for MoE, the active experts.
    Attention as in `attention_flops_per_token` (full T×T unless causal=True). Activation recomputation is not
    counted: this is the model FLOPs of MFU, not the hardware FLOPs.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6.0 * matmul_params(cfg, active_only) + attention_flops_per_token(cfg, seq_len, causal)


def kaplan_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Kaplan et al. 2020, Table 1, ×3 for training: 6·N + 6·L·T·d_attn, N = non-embedding parameters.

    Biases and norms are in Kaplan's N (they are a negligible part of it); the output projection is not.
    """
    d_attn = cfg.n_heads * cfg.head_dim
    return 6.0 * count_params(cfg, include_embeddings=False) + 6.0 * cfg.n_layers * seq_len * d_attn


def palm_flops_per_token(n_params: float, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Chowdhery et al. 2022 (PaLM), Appendix B: 6·N + 12·L·H·Q·T, from the published numbers of a model."""
    return 6.0 * n_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def training_flops(n_params: float, n_tokens: float) -> float:
    """C = 6·N·D: the training compute of N parameters on D tokens (Kaplan et al. 2020, §2.1; Hoffmann et al. 2022)."""
    return 6.0 * n_params * n_tokens


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization (PaLM, Appendix B): achieved model FLOP/s over the peak FLOP/s of the hardware used.

    Give the peak of all chips together (per-chip peak × chips) with the throughput of the whole job. On a CPU,
    pass a peak measured with `measure_matmul_peak`: the result is then relative to the best matmul that machine
    does, not to a datasheet figure.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return tokens_per_second * flops_per_token / peak_flops


# ------------------------------------------------------------------------------------------------------------------
# the peak MFU divides by, measured where no datasheet applies, and the meter


def model_matmul_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """The (m, k, n) of the model's own forward matmuls for `tokens` tokens: qkv, the feed-forward, the head."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    shapes = [(tokens, d, cfg.n_heads * cfg.head_dim), (tokens, d, kv), (tokens, d, cfg.d_ff),
              (tokens, cfg.d_ff, d), (tokens, d, cfg.vocab_size)]
    return sorted(set(shapes))


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """A function that runs `fn` `n` times and returns the seconds it took on `device`."""
    if device.type == "cuda":
        def run(fn: Callable[[], object], n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # ms -> s
        return run

    def run_cpu(fn: Callable[[], object], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - start
    return run_cpu


def measure_matmul_peak(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        min_seconds: float = 1.0) -> tuple[float, tuple[int, int, int]]:
    """The best FLOP/s (2·m·k·n per matmul) over `shapes`, each timed in batches for min_seconds/len(shapes) after
    one warm-up batch; returns (FLOP/s, the shape that reached it)."""
    if not shapes or min_seconds <= 0:
        raise ValueError(f"need at least one shape and min_seconds > 0, got {len(shapes)} shapes, {min_seconds}")
    device = torch.device(device)
    timer, budget = _timer(device), min_seconds / len(shapes)
    best, best_shape = 0.0, shapes[0]
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        fn = functools.partial(torch.mm, a, b)
        reps = 1
        timer(fn, 1)  # warm-up: allocation, kernel selection
        spent = 0.0
        while spent < budget:
            seconds = timer(fn, reps)
            spent += seconds
            if seconds > 0 and 2.0 * m * k * n * reps / seconds > best:
                best, best_shape = 2.0 * m * k * n * reps / seconds, (m, k, n)
            reps = min(reps * 2, 64) if seconds < budget / 8 else reps  # batches long enough to time well
    return best, best_shape


def peak_for_device(device: torch.device, dtype: str, override: float | None, cfg: ModelConfig,
                    tokens: int, min_seconds: float = 1.0) -> tuple[float, str]:
    """Peak FLOP/s of one device for MFU and its source: --peak-flops, the datasheet of a known GPU, else measured
    over square shapes and the model's own matmuls (`tokens` per micro-batch)."""
    if override:
        return override, "set by --peak-flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = datasheet_chip(name)
        if chip is not None:  # fp8: the FP8 tensor-core peak (1979 TFLOP/s dense on an H100/H200 SXM)
            peak_dtype = dtype if dtype == "fp8" else "bf16"
            return (peak_flops(chip, peak_dtype),
                    f"datasheet dense {peak_dtype} peak of {chip} ({name}); see minidist/hardware.py")
    if dtype == "fp8":  # no FP8 tensor cores: the FP8 GEMMs are emulated, measured against the fp32 matmul peak
        dtype = "fp32"
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    shapes = [(s, s, s) for s in (512, 1024, 2048)] + model_matmul_shapes(cfg, tokens)
    peak, (m, k, n) = measure_matmul_peak(shapes, torch_dtype, device, min_seconds)
    return peak, (f"measured {device.type} {dtype} matmul peak: best of {len(shapes)} shapes (squares and the "
                  f"model's own) over >= {min_seconds:g} s, reached at {m}x{k}x{n}")


class MfuMeter:
    """MFU per step and cumulative. A measured peak (a CPU's matmuls, or --peak-flops) is a lower bound of what the
    device can do, so a step that beats it raises it (MFU <= 1). A datasheet peak (`datasheet=True`, a known GPU) is
    the hardware's ceiling: a step above it is a timing bug (the clock stopped before the device finished, e.g.
    without a synchronize), not a faster chip. It is never raised; the first such step prints a note saying so,
    and MFU is reported as measured, above 100%, so the bug shows in every figure instead of being absorbed into a
    made-up peak. (A note rather than an error: a wrong clock spoils the figures, not the training.)"""

    def __init__(self, flops_per_token: float, peak_flops: float, datasheet: bool = False) -> None:
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
        self.flops_per_token = flops_per_token
        self.peak = peak_flops  # of the whole job: per-device peak × devices
        self.datasheet = datasheet
        self.raised_from: float | None = None
        self.above_datasheet = False  # a step beat the datasheet peak (reported once)
        self.flops = 0.0  # the counted steps' model FLOPs
        self.seconds = 0.0

    def step(self, tokens: int, seconds: float, count: bool = True, flops: float | None = None
             ) -> tuple[float, str | None]:
        """This step's MFU, and a message the first time a step beat the peak (a measured peak is then raised to it).
        count=False leaves the step out of the cumulative figure (the first step pays one-time costs). `flops`: the
        step's model FLOPs when they are not tokens × flops_per_token (a document mask: `step_flops`)."""
        flops = tokens * self.flops_per_token if flops is None else flops
        achieved = flops / seconds
        message = None
        if achieved > self.peak and self.datasheet:
            if not self.above_datasheet:
                message = (f"note: a step reached {achieved / 1e9:,.1f} GFLOP/s, above the datasheet peak "
                           f"{self.peak / 1e9:,.1f}: a timing bug (the step clock stopped before the device finished "
                           "its work), not a faster chip; MFU is reported as measured, above 100%")
                self.above_datasheet = True
        elif achieved > self.peak:
            if self.raised_from is None:
                message = (f"note: a step reached {achieved / 1e9:,.1f} GFLOP/s, above the peak "
                           f"{self.peak / 1e9:,.1f}; the peak is raised to what was achieved (MFU stays <= 100%)")
                self.raised_from = self.peak
            self.peak = achieved
        if count:
            self.flops += flops
            self.seconds += seconds
        return achieved / self.peak, message

    @property
    def cumulative(self) -> float:
        """Total model FLOPs over total counted step time, against the final peak."""
        return self.flops / (self.seconds * self.peak) if self.seconds else 0.0
