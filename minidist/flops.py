"""Parameter counts, FLOPs per token, MFU, and the peak FLOP/s of the chips people train on (chapter 01).

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
"""

from __future__ import annotations

import time

import torch

from minidist.model.config import ModelConfig

# Dense (no 2:4 sparsity) bf16 peak of one chip, FLOP/s. Vendors print the sparse figure, twice the dense one.
PEAK_FLOPS_BF16: dict[str, float] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2020): BF16 Tensor Core 312 TFLOPS (624 with sparsity); SXM and PCIe.
    "A100": 312e12,
    # NVIDIA H100 Tensor Core GPU datasheet (2023): H100 SXM BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.
    "H100-SXM": 989e12,
    # Same datasheet, H100 PCIe: 1,513 TFLOPS with sparsity -> 756 dense.
    "H100-PCIe": 756e12,
    # Same datasheet, H100 NVL (per GPU of the pair): 1,671 TFLOPS with sparsity -> 835 dense (lower clocks, 400 W).
    "H100-NVL": 835e12,
    # NVIDIA H800 SXM product brief: the H100 SXM's compute (1,979 TFLOPS sparse bf16) with cut NVLink -> 989.
    "H800": 989e12,
    # NVIDIA H200 Tensor Core GPU datasheet (2024): H200 SXM BF16 1,979 TFLOPS with sparsity -> 989 dense.
    "H200-SXM": 989e12,
    # Same datasheet, H200 NVL: 1,671 TFLOPS with sparsity -> 835 dense.
    "H200-NVL": 835e12,
    # NVIDIA HGX B200 datasheet (2024): FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity -> 2.25 dense.
    "B200": 2250e12,
    # Google TPU v4: 275 TFLOPS bf16 per chip (Jouppi et al. 2023; the peak PaLM's MFU is measured against).
    "TPUv4": 275e12,
}


def peak_flops(chip: str) -> float:
    """Dense bf16 peak FLOP/s of one chip from `PEAK_FLOPS_BF16`. A CPU has no such entry: use `measure_peak_flops`."""
    if chip not in PEAK_FLOPS_BF16:
        raise ValueError(f"no peak FLOP/s for {chip!r}; known chips: {sorted(PEAK_FLOPS_BF16)} "
                         "(for a CPU, measure matmuls with minidist.peak.measure_matmul_peak)")
    return PEAK_FLOPS_BF16[chip]


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
    pass a peak measured with `measure_peak_flops`: the result is then relative to the best matmul that machine
    does, not to a datasheet figure.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return tokens_per_second * flops_per_token / peak_flops


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = 2048, device: str | torch.device = "cpu",
                       repeats: int = 5, warmup: int = 2) -> float:
    """FLOP/s of a square [size, size] @ [size, size] matmul on `device`: 2·size³ over the fastest of `repeats` runs.

    A CPU has no meaningful datasheet peak for our purposes (it depends on cores, clocks, vector width and the BLAS
    library), so MFU on a CPU is reported against this measured matmul peak. It is an achievable ceiling, not the
    theoretical one: an MFU against it says how close the model gets to the machine's own best large matmul.
    """
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats must be >= 1, got size={size}, repeats={repeats}")
    device = torch.device(device)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 2.0 * size**3 / min(times)
