"""Chapter 01 exercises: parameters and FLOPs of a mixture-of-experts model, and the days a training run takes.

Grade your answers with `make grade CH=01`. The grader builds each model (on PyTorch's meta device) and counts its
parameters, runs a real forward and backward pass under `torch.utils.flop_counter.FlopCounterMode`, and compares
your training times with the ones Narayanan et al. 2021 published for GPT-3 and a trillion-parameter model.

The notebook counts dense models. Here some blocks replace their feed-forward network by a mixture of experts
(MoE, chapter 06 builds it; you need only its shapes, listed below): a token goes to `top_k` of `n_experts`
expert networks, so the model *stores* every expert but each token *uses* only a few. The configs are
`minidist.model.config.ModelConfig` with attention == "gqa" (MHA and MQA included; no MLA here). Fields you need:

  vocab_size V, d_model d, n_layers L, n_heads H, n_kv_heads H_kv, head_dim Q = d / H, d_ff f, max_seq_len,
  mlp ("swiglu" or "gelu"), norm ("rmsnorm" or "layernorm"), bias, position ("rope" or "learned"),
  tie_embeddings, and cfg.moe: n_experts N (0 = a dense model), top_k k, n_shared_experts, d_expert
  (None means d_ff), first_dense_layers (the first blocks keep a dense MLP).

What `minidist.model.Transformer(cfg)` holds:
  - token embedding V·d; learned position embedding max_seq_len·d when position == "learned" (none for RoPE);
  - per block: attention W_q (d -> H·Q), W_k and W_v (d -> H_kv·Q each), W_o (H·Q -> d), each with a bias
    when cfg.bias; two norms; and an MLP:
      dense SwiGLU: w1, w3 (d -> f) and w2 (f -> d), biases when cfg.bias;
      dense GELU: w1 (d -> f), w2 (f -> d), biases when cfg.bias;
      MoE (blocks number >= first_dense_layers, when N > 0): a router d -> N (no bias); N routed experts, each a
      SwiGLU with hidden size d_expert and no biases; shared experts: one SwiGLU of hidden size
      n_shared_experts·d_expert, no biases, which every token goes through;
  - a final norm; RMSNorm has a gain of size d, LayerNorm a gain and (when cfg.bias) a bias;
  - lm_head d -> V, no bias; with tie_embeddings it *is* the token embedding (one tensor, counted once).
"""

from minidist.model.config import ModelConfig


def moe_param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """Return (total, active): the parameters `Transformer(cfg)` stores, and those one token uses.

    total equals sum(p.numel() for p in Transformer(cfg).parameters()), for dense and MoE configs alike.
    active is total minus the routed experts a token is not sent to: in every MoE layer a token uses the router,
    the shared experts and k of the N routed experts, so it skips (N − k) experts of 3·d·d_expert weights each.
    Everything else (embeddings, attention, norms, dense MLPs, lm_head) counts as active, as in
    `minidist.flops.count_params(cfg, active_only=True)` — which you must not call, of course.

    Start from the notebook's `n_params` (chapter 01, section 3) and change the feed-forward part per block:
    blocks 0 .. first_dense_layers − 1 are dense, the others MoE. For a dense config (N = 0) both numbers are
    equal. Mixtral 8×7B's shape (Jiang et al. 2024) gives about 46.7B total and 12.9B active.

    Hints: the dense blocks of a GPT-style config keep their biases, the MoE parts have none; a LayerNorm with
    bias=True has 2·d parameters; tied embeddings mean no separate lm_head parameters.
    """
    raise NotImplementedError("exercise: count the stored and the used parameters of an MoE transformer")


def moe_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token in PaLM's convention: 6·N_active + 12·L·H·Q·T.

    N_active counts the weights that multiply every token: attention W_q, W_k, W_v, W_o; the dense MLPs' weight
    matrices; in MoE layers the router (d·N), the shared experts and k routed experts (3·d·d_expert each); and the
    output projection d·V, which is a real matmul for every token even when it is tied to the embedding. Leave
    out the input embeddings (a table lookup: no arithmetic), norms and biases (elementwise, not matmuls), and the
    routed experts a token is not sent to. The attention term is the full T×T score and value matmuls of all
    layers, 4·T·H·Q per layer forward, ×3 for training.

    The grader runs a real train step of each config under FlopCounterMode (attention on the math backend, so the
    score matmuls are visible; the experts one matmul per expert) and divides by the number of tokens: your
    integer must equal that count exactly. Routing needs no guesswork: without a capacity limit every token
    occupies exactly k expert slots, whichever experts they are.

    Hint: the notebook's `flops_per_token_nb` is the dense case; reuse your `moe_param_counts` reasoning for the
    weights, dropping what is not a matmul.
    """
    raise NotImplementedError("exercise: 6 × the active matmul weights + the attention term")


def training_days(n_params: float, n_tokens: float, n_gpus: int, flops_per_gpu: float,
                  recompute: bool = False) -> float:
    """Wall-clock days to train n_params parameters on n_tokens tokens with n_gpus GPUs, each sustaining
    flops_per_gpu FLOP/s of *achieved* throughput (a datasheet peak × the MFU you reach).

    Without recomputation a run costs C = 6·N·D FLOPs (2 forward + 4 backward per parameter and token; attention
    left out, as scaling-law papers do). With full activation recomputation (recompute=True) the forward pass
    runs a second time during the backward: 8·N·D. Time = C / (n_gpus · flops_per_gpu) seconds; a day is
    86,400 s.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    §5.1) estimate with exactly this formula, 8·T·P/(n·X): GPT-3 (175B parameters, 300B tokens) on 1024 A100s at
    140 TFLOP/s each takes about 34 days. The grader checks that number and a second one from the same paper.

    Hint: check the units first — FLOPs / (FLOP/s) gives seconds.
    """
    raise NotImplementedError("exercise: (6 or 8)·N·D FLOPs at n_gpus × flops_per_gpu, in days")
