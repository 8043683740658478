"""One dataclass describes every model in the course, from the CPU-sized `tiny` to the shapes of GPT-3 and Llama.

The model code reads only this config; parallel transformations read it too (to check that heads, vocabulary and
layers divide across ranks). Sub-configs group the options of one chapter: RoPE scaling (04), MLA (05), MoE (06).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RopeScalingConfig:
    """Context extension of RoPE (chapter 04). kind: "none", "linear" (position interpolation), "ntk", "yarn"."""

    kind: str = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None  # the context the model was trained at; needed by "yarn"
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def validate(self) -> None:
        kinds = ("none", "linear", "ntk", "yarn")
        if self.kind not in kinds:
            raise ValueError(f"rope scaling kind {self.kind!r} is unknown; choose one of {kinds}")
        if self.factor < 1.0:
            raise ValueError(f"rope scaling factor must be >= 1 (it stretches the context), got {self.factor}")
        if self.kind == "yarn" and not self.original_max_seq_len:
            raise ValueError("rope scaling 'yarn' needs original_max_seq_len (the context the model was trained at)")
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"rope scaling 'yarn' needs beta_fast > beta_slow > 0, "
                             f"got {self.beta_fast}, {self.beta_slow}")


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, chapter 05). Used when ModelConfig.attention == "mla"."""

    q_lora_rank: int | None = None  # None: queries are not compressed (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16

    def validate(self, cfg: ModelConfig) -> None:
        """One-line ValueError for the first inconsistent MLA option; nothing to check unless attention == "mla"."""
        if cfg.attention != "mla":
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"mla {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions, so mla qk_rope_head_dim must be even, "
                             f"got {self.qk_rope_head_dim}")
        # A latent wider than the model would be no compression at all (the down-projection could not lose rank).
        for name in ("kv_lora_rank", "q_lora_rank"):
            rank = getattr(self, name)
            if rank is not None and not 1 <= rank <= cfg.d_model:
                raise ValueError(f"mla {name}={rank} must be in 1..d_model={cfg.d_model} (a low-rank latent)"
                                 + (" or None (no query compression)" if name == "q_lora_rank" else ""))


@dataclass
class MoEConfig:
    """Mixture of experts (chapter 06). Used when n_experts > 0: every block's MLP becomes an MoE layer.

    Experts are SwiGLU networks of hidden size d_expert (whatever ModelConfig.mlp says); shared experts are one
    SwiGLU of hidden size n_shared_experts·d_expert that every token goes through.
    """

    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    d_expert: int | None = None  # hidden size of one expert; None: the dense d_ff
    router: str = "softmax"  # "softmax" (Switch / Mixtral) or "sigmoid" (DeepSeek-V3)
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_speed: float = 0.0  # > 0: DeepSeek-V3 auxiliary-loss-free balancing
    first_dense_layers: int = 0  # DeepSeek keeps the first blocks dense
    # Divide the k selected gates by their sum. None: only when top_k > 1 (Switch top-1 keeps p_i, else the gate
    # would be the constant 1 and the router would get no gradient from the language-model loss).
    renormalize: bool | None = None
    routed_scaling_factor: float = 1.0  # multiplies the routed gates (DeepSeek-V3 uses 2.5)

    def renormalizes(self) -> bool:
        return self.top_k > 1 if self.renormalize is None else self.renormalize

    def validate(self, cfg: ModelConfig) -> None:
        """One-line ValueError for the first inconsistent MoE option; nothing to check for a dense model."""
        if self.n_experts < 0:
            raise ValueError(f"moe n_experts must be >= 0 (0: dense MLP), got {self.n_experts}")
        if self.n_experts == 0:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"moe top_k={self.top_k} does not fit n_experts={self.n_experts}; "
                             f"pick top_k in 1..{self.n_experts}")
        routers = ("softmax", "sigmoid")
        if self.router not in routers:
            raise ValueError(f"moe router {self.router!r} is unknown; choose one of {routers}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}")
        if self.d_expert is not None and self.d_expert < 1:
            raise ValueError(f"moe d_expert must be >= 1 (or None for d_ff), got {self.d_expert}")
        if self.n_shared_experts < 0:
            raise ValueError(f"moe n_shared_experts must be >= 0, got {self.n_shared_experts}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_speed"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe {name} must be >= 0, got {getattr(self, name)}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"moe routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        if not 0 <= self.first_dense_layers <= cfg.n_layers:
            raise ValueError(f"moe first_dense_layers={self.first_dense_layers} must be in 0..n_layers={cfg.n_layers}")


@dataclass
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (MHA); 1: MQA; in between: GQA
    d_ff: int | None = None  # None: 4·d_model for "gelu", ≈ 8/3·d_model rounded up to a multiple of 32 for "swiglu"
    max_seq_len: int = 256
    mlp: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT-2/3)
    norm: str = "rmsnorm"  # "rmsnorm" (Llama) or "layernorm" (GPT-2/3)
    norm_eps: float = 1e-5
    bias: bool = False  # biases in linear layers (GPT-2/3 have them)
    position: str = "rope"  # "rope" or "learned" (GPT-2/3 absolute position embeddings)
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    rope_layout: str = "half"  # "half" (rotate_half, as in HF Llama) or "interleaved" (pairs (2i, 2i+1), Meta/GPT-J)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    attention: str = "gqa"  # "gqa" (covers MHA and MQA) or "mla"
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            if self.mlp == "gelu":
                self.d_ff = 4 * self.d_model
            else:
                self.d_ff = 32 * ((8 * self.d_model // 3 + 31) // 32)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> ModelConfig:
        """Raise a one-line ValueError for the first inconsistent value; return self when all is well."""
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"pick n_heads from {_divisors(self.d_model)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                f"pick n_kv_heads from {_divisors(self.n_heads)}"
            )
        choices = {"mlp": ("swiglu", "gelu"), "norm": ("rmsnorm", "layernorm"), "position": ("rope", "learned"),
                   "rope_layout": ("half", "interleaved"), "attention": ("gqa", "mla")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"model {name}={getattr(self, name)!r} is unknown; choose one of {allowed}")
        if self.position == "rope" and self.attention == "gqa" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions, so head_dim must be even, got {self.head_dim}")
        self.rope_scaling.validate()
        self.mla.validate(self)
        self.moe.validate(self)
        return self

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (nested sub-configs may be given as dicts)."""
        return config_from_dict({**config_to_dict(self), **changes})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from plain values (a TOML table), with a one-line error for unknown keys."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown model option(s) {unknown}; known options: {sorted(known)}")
    values = dict(values)
    for name, cls in (("rope_scaling", RopeScalingConfig), ("mla", MLAConfig), ("moe", MoEConfig)):
        sub = values.get(name)
        if isinstance(sub, dict):
            sub_known = {f.name for f in dataclasses.fields(cls)}
            bad = sorted(set(sub) - sub_known)
            if bad:
                raise ValueError(f"unknown {name} option(s) {bad}; known options: {sorted(sub_known)}")
            values[name] = cls(**sub)
    return ModelConfig(**values)


# Shapes of real models, for FLOPs and memory arithmetic (chapter 01), and small ones that train on a CPU.
PRESETS: dict[str, dict[str, Any]] = {
    # Trains on 2 CPU cores in minutes; every parallel layout of the course divides it (heads 4, kv 2, vocab 256).
    "tiny": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256),
    "small": dict(vocab_size=256, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=512),
    # Radford et al. 2019 (GPT-2 small): 124M parameters with tied embeddings.
    "gpt2-124m": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=1024,
                      mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True),
    # Brown et al. 2020, Table 2.1 (GPT-3 175B).
    "gpt3-175b": dict(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, d_ff=49152, max_seq_len=2048,
                      mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True),
    # Touvron et al. 2023 (Llama 2), Table 1 and the released configs.
    "llama2-7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096,
                      norm_eps=1e-5),
    "llama2-70b": dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                       max_seq_len=4096, norm_eps=1e-5),
    # Llama 3 herd paper (Grattafiori et al. 2024), Table 3.
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                      max_seq_len=8192, rope_base=500000.0, norm_eps=1e-5),
    # Same paper, Table 3 (405B): 126 layers, d 16,384, FFN 53,248, 128 heads, 8 KV heads.
    "llama3-405b": dict(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, d_ff=53248,
                        max_seq_len=8192, rope_base=500000.0, norm_eps=1e-5),
}


# Mixture-of-experts shapes with latent attention: kept apart from PRESETS, whose dense GQA shapes chapter 01 counts
# with its own closed formula; `get_preset` finds both.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" §4.2 and the released config: 61 layers (the first 3 dense),
    # MLA, 1 shared + 256 routed experts of 2,048, top-8 sigmoid routing scaled by 2.5; pre-trained at 4K tokens.
    # Not represented: the multi-token-prediction module, node-limited routing (n_group, topk_group).
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, d_ff=18432, max_seq_len=4096,
                        norm_eps=1e-6, attention="mla",
                        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128),
                        moe=dict(n_experts=256, top_k=8, n_shared_experts=1, d_expert=2048, router="sigmoid",
                                 routed_scaling_factor=2.5, first_dense_layers=3, bias_update_speed=0.001)),
}


ALL_PRESETS: dict[str, dict[str, Any]] = {**PRESETS, **MOE_PRESETS}  # what `get_preset` and the commands accept


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, optionally with fields overridden; one-line error for an unknown name."""
    if name not in ALL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(ALL_PRESETS)}")
    return config_from_dict({**ALL_PRESETS[name], **overrides}).validate()
