"""The trainer's settings as one dataclass, `TrainConfig`, and the error a bad one raises. Read by
`minidist.train.config` (defaults < TOML < flags < --set), checked by `minidist.train.config_checks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad setting. The command line prints it as one line on stderr and exits with code 2."""


class RankConfigError(ConfigError):
    """A bad input one rank found after the process groups exist (its rank file, its fault drill): each rank
    prints its own, starting with its rank, where a ConfigError of the pre-flight (the same on all) is said once."""


@dataclass
class TrainConfig:
    """Every setting of a run. TOML keys and flags have the same names (flags with '-' for '_').

    The model is a preset plus overrides: `[model]` in TOML holds `preset = "tiny"` and any ModelConfig field
    (`n_layers = 2`, `moe = {n_experts = 4}`); on the command line `--model tiny --set model.n_layers=2`.
    """

    # model
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    # data: "stdlib" (the standard library's source), a text file, a directory of text files, a .bin or .npy file,
    # or a prepared dataset directory (minidist.data.prepare; told apart by its manifest.json)
    data: str = "stdlib"
    max_bytes: int | None = None
    val_fraction: float = 0.05
    doc_mask: bool = False  # attention within each document (block-diagonal causal), positions restart at each
    # batch: global sizes, whatever the layout
    batch_size: int = 16
    seq_len: int = 128
    microbatches: int = 1
    # optimizer and schedule
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # precision and device
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU (minidist.precision)
    fp8: str = "none"  # FP8 GEMMs of the blocks' linears: none, tensorwise, rowwise, blockwise (model/fp8_linear.py)
    fp8_block: int = 128  # the blockwise recipe's tile/block size (1 x B activations, B x B weights)
    recompute: str = "none"  # activation recomputation: none, selective (keep matmul outputs) or full (each block)
    loss_chunk: int = 0  # tokens per chunk of the head + cross-entropy (0: the whole micro-batch at once)
    attention_kernel: str = "sdpa"  # the attention core: sdpa (the model's own) or triton (chapter 19's kernel)
    compile: bool | None = None  # torch.compile each transformer block; None: on CUDA (with Triton), off elsewhere
    compile_backend: str = "inductor"  # torch.compile's backend: inductor, aot_eager (no codegen), eager (dynamo only)
    expert_backend: str = "auto"  # routed experts' kernel: auto (grouped_mm where CUDA's rule holds), loop, grouped_mm
    device: str = "auto"
    # parallel layout (dp None: whatever the other dimensions leave of the world size)
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_impl: str = "ring"  # context-parallel attention (with cp > 1): ring, allgather, ulysses
    ep: int = 1
    zero: int = 0
    bucket_mb: float | None = None  # gradient bucket cap in MiB (None: 25 on CUDA, 4 on a CPU)
    sp: bool = False  # sequence parallel (with tp > 1)
    tp_reduce_fp32: bool = False  # sum the tensor-parallel partial sums in fp32 (under bf16)
    schedule: str = "1f1b"  # pipeline schedule (with pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    # evaluation, logging, checkpoints
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 100
    keep: int = 3  # checkpoints kept: the newest ones (and always the one `latest` names)
    resume: bool = False
    stop_after: int = 0  # end cleanly after N completed steps (checkpoint at N), the schedule of --steps
    overwrite: bool = False  # replace the run in OUT (its checkpoints, metrics, run.json, loss.png)
    out: str = "runs/tiny"
    seed: int = 0
    peak_flops: float | None = None
    plot: bool = True
    tensorboard: bool = False  # write metrics.jsonl's figures as TensorBoard events in OUT/tensorboard/ (dashboard.py)
    profile_steps: str | None = None  # A:B: a torch.profiler trace per rank of steps A..B, OUT/profile/ (profiling.py)
    # trust nothing (minidist.trust.replicas, minidist.trust.faults)
    check_every: int = 50  # compare replicas every N steps, at every checkpoint, at resume and at the end
    comm_timeout: float = 300.0  # seconds a collective may wait for a peer before the job stops
    ckpt_timeout: float = 1800.0  # seconds the barriers around writing and reading checkpoints wait for a peer
    inject_fault: str | None = None  # a fault drill: bitflip:STEP:RANK[:NAME]


def config_to_values(cfg: TrainConfig) -> dict[str, Any]:
    """The inverse of `config_from_values` (what run.json and checkpoints record)."""
    values = dataclasses.asdict(cfg)
    values["model"] = {"preset": values.pop("model"), **values.pop("model_overrides")}
    return values
