"""Multi-token prediction as the planner counts it (DeepSeek-AI 2024, *DeepSeek-V3 Technical Report*, §2.2,
"Multi-Token Prediction"): D sequential modules after the main model, module k predicting the token k + 1 ahead.
Each is one block like the model's last, a projection M_k from the concatenation [RMSNorm(h), RMSNorm(emb)] (2d)
to d, and the output head shared with the main model (§3.2.3: placed on the pipeline rank that holds the head).
DeepSeek-V3 trains with D = 1; the module's cost is part of every step of its published run.

The planner models the D blocks as D more layers at the end of the model (`with_mtp`): their FLOPs, parameters
and saved activations, with the pipeline's chunks split over them as over the model's own layers (a run balances
its stages so: the module's block in the last chunk, a main layer fewer there where the split is uneven, as Llama 3
gives its first and last stage a layer fewer for the embedding and the head). The rest is counted here: the
projections and the second pass through the head (`head_flops_per_token`), the projections' and norms' weights
and the head's logits again on the head's rank (`head_params`, `head_activation_bytes`). The trainer does not train with
multi-token prediction: this is the planner's model of a run that does.
"""

from __future__ import annotations

import dataclasses

from minidist.model.config import ModelConfig


def check_depth(depth: int) -> None:
    if not 0 <= depth <= 8:
        raise ValueError(f"--mtp-depth must be in 0..8 (DeepSeek-V3 trains with 1), got {depth}")


def with_mtp(cfg: ModelConfig, depth: int) -> ModelConfig:
    """`cfg` with the D modules' blocks as D more layers after its last."""
    check_depth(depth)
    return dataclasses.replace(cfg, n_layers=cfg.n_layers + depth) if depth else cfg


def head_flops_per_token(cfg: ModelConfig, depth: int) -> float:
    """Training FLOPs per token of the modules' projections (2d → d) and their passes through the head."""
    return 6.0 * depth * (2 * cfg.d_model * cfg.d_model + cfg.d_model * cfg.vocab_size)


def head_params(cfg: ModelConfig, depth: int, tp: int) -> int:
    """Weights on the head's rank besides the blocks: each module's projection (split over tp) and three RMSNorm
    gains (its two input norms and the norm before the shared head)."""
    return depth * (2 * cfg.d_model * cfg.d_model // tp + 3 * cfg.d_model)


def head_activation_bytes(cfg: ModelConfig, tokens: int, tp: int, p: int) -> float:
    """Bytes one module keeps on the head's rank per micro-batch beside its block: the projection's input (2d) and
    the loss's fp32 softmax over the vocabulary shard, as the main head's."""
    return p * tokens * 2 * cfg.d_model + 4 * tokens * cfg.vocab_size / tp + 8 * tokens
