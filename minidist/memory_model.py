"""Memory model: how many bytes training holds, by part, from the shapes alone (measured in `memory`).

* Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  §3.1): mixed-precision Adam holds 16-bit parameters and gradients (2 + 2 bytes per parameter) and, in fp32, a
  master copy of the parameters and the two Adam moments (4 + 4 + 4 = 12 bytes): 16 bytes per parameter. Plain
  fp32 training holds 4 + 4 + 8 = 16 bytes too, without the master copy.
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4):
  a GPT layer in 16-bit saves s·b·h·(34 + 5·a·s/h) bytes for the backward; the 5·a·s²·b part (softmax output,
  its dropout mask and the dropout output) is what a fused attention kernel (FlashAttention, SDPA) does not keep.
  `activation_bytes_per_layer` counts the same thing for this course's Llama block, tensor by tensor.
"""

from __future__ import annotations

from minidist.model.config import ModelConfig


def model_state_bytes(n_params: int, param_bytes: int = 2, grad_bytes: int = 2, master_bytes: int = 4,
                      optimizer_bytes: int = 8) -> dict[str, int]:
    """Bytes of parameters, gradients, fp32 master copy and optimizer state (AdamW: two moments) for n_params.

    Defaults: bf16 mixed precision, 2 + 2 + 4 + 8 = 16 bytes per parameter (ZeRO §3.1). Plain fp32 AdamW:
    param_bytes=4, grad_bytes=4, master_bytes=0 (the parameters are the master copy). Leaves out the optimizer's
    per-tensor step counters and the allocator's rounding.
    """
    parts = {"params": param_bytes * n_params, "grads": grad_bytes * n_params, "master": master_bytes * n_params,
             "optimizer": optimizer_bytes * n_params}
    parts["total"] = sum(parts.values())
    return parts


def korthikanti_activation_bytes(seq_len: int, batch: int, d_model: int, n_heads: int, flash: bool = False) -> int:
    """Korthikanti et al. 2022 §4, one GPT layer in 16-bit, no parallelism: s·b·h·(34 + 5·a·s/h) bytes.

    flash=True drops the 5·a·s²·b term (a fused kernel recomputes the scores in the backward instead of keeping
    the s × s softmax, its dropout mask and output); the per-row softmax statistics it keeps are O(s), left out.
    """
    s, b, h, a = seq_len, batch, d_model, n_heads
    return s * b * h * 34 + (0 if flash else 5 * a * s * s * b)


def activation_bytes_per_layer(cfg: ModelConfig, seq_len: int, batch: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one `minidist.model.Block` (RMSNorm, GQA with RoPE and fused SDPA, SwiGLU; no dropout) saves for
    the backward, by part, with activations of dtype_bytes (2: bf16, 4: fp32).

    Derived from what autograd saves for each operator of the block:
    * each RMSNorm: its input upcast to fp32 (4·bsh), 1/rms (4·bs, fp32), the normalized tensor before the gain
      and the output (the linear layers' input), dtype_bytes·bsh each;
    * attention: q (bsh), k and v (b·s·kv_heads·head_dim each), SDPA's output and its contiguous copy (the output
      projection's input), plus the fused kernel's fp32 log-sum-exp (4·b·heads·s) — no s × s tensor;
    * SwiGLU: the two up-projections, the SiLU output and the product (the down-projection's input), bsf each.
    Not in it: RoPE's cos/sin (shared by all layers), the embedding, final norm, logits and loss.
    """
    s, b, h, p = seq_len, batch, cfg.d_model, dtype_bytes
    kv = cfg.n_kv_heads * cfg.head_dim
    norms = 2 * (4 * b * s * h + 4 * b * s + 2 * p * b * s * h)
    attention = p * (3 * b * s * h + 2 * b * s * kv) + 4 * b * cfg.n_heads * s
    mlp = 4 * p * b * s * cfg.d_ff
    return {"norms": norms, "attention": attention, "mlp": mlp, "total": norms + attention + mlp}
