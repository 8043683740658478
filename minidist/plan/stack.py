"""A training stack's memory rules and abilities as data (`--stack NAME|FILE.toml`, chapter 12).

A stack is what a run's software keeps per parameter and per GPU, and what it can run. The fields of a stack TOML
file (every one optional; an omitted one takes the `trainer` preset's value):

* `param_bytes`, `grad_bytes`: bytes per parameter of the weights and of the gradients (2 for bf16, 4 for fp32);
* `master_bytes`: of the fp32 master copy (0 when the weights are the master copy), sharded from ZeRO-1;
* `optimizer_bytes`: of the optimizer's state beside it (8 for AdamW's two fp32 moments, 4 in bf16), sharded from
  ZeRO-1;
* `grad_buffer`: "sharded" (gradients follow ZeRO: sharded from stage 2) or "full" (a buffer of `grad_bytes` per
  parameter of the rank's model shard whatever the ZeRO stage, as Megatron-LM's DDP `main_grad` and DeepSpeed's
  BF16 optimizer keep one);
* `grad_copy_bytes`: of gradients kept whole beside those until the step (autograd's bf16 `.grad` a stack adds into
  an fp32 buffer and frees only at the step: nanotron's 2); `ddp_bucket_bytes`: of torch DDP's flat buckets, whole,
  for every parameter with replicas (without `gradient_as_bucket_view` they are a second copy of the gradients:
  nanotron's 2); both 0 by default;
* `sp_inputs`: "gathered" (an SP column-parallel linear keeps its gathered input) or "sharded" (keeps its shard and
  gathers it again backward: Megatron-LM's and nanotron's `tp_recompute_allgather`); omitted: as `activations`' kernels;
* `activations`: whose kernels' saved tensors, "trainer" (this trainer's: an fp32 copy in RMSNorm, SP linears keep
  their gathered input), "megatron" (fused RMSNorm, RoPE and SwiGLU, SP inputs kept sharded) or "deepseek"
  (DeepSeek-V3's: FP8 copies, norms, SwiGLU and MLA's up-projections recomputed; needs --fp8);
* `norm`: "eager" (RMSNorm over an fp32 copy of its input, which autograd keeps) or "fused" (one kernel that keeps
  its input as it is and 1/rms); omitted: as `activations`' kernels have it (eager for "trainer", fused otherwise);
* `loss`: "eager" (cross-entropy over an fp32 copy of the logits: 8 bytes per logit beyond the saved softmax at its
  peak) or "fused" (Megatron-LM's vocab-parallel kernel, in place: 2); omitted: as `activations`' kernels;
* `selective`: what `recompute = "selective"` keeps of a block: "matmuls" (this trainer's: every matmul's and the
  attention kernel's output), "alternate_matmuls" (torchtitan's op-level policy: every second matmul recomputed) or
  "core_attention" (Megatron-LM's: only the attention core recomputed, under FlashAttention the bytes of none);
  omitted: "matmuls" for the "trainer" activations, "core_attention" for the others;
* `reserved_gib`: GiB per GPU the layouts may not use (CUDA context, NCCL buffers, the allocator's slack); omitted:
  10% of the chip's memory;
* what the stack can run, restricting the search: `schedules` (of 1f1b, interleaved, zb1, zbv, dualpipev),
  `zero_stages` (of 0-3), `cp` (its context-parallel attention: of ring, allgather; [] for none), `recompute` (of
  none, selective, full), `max_tp` (0: no limit), `sequence_parallel` (false: tp keeps whole activations between
  its regions, as Megatron-LM did before 2022).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minidist.plan.rank_memory import BF16_DEEPSEEK, BF16_MEGATRON, BF16_MIXED, SELECTIVE_POLICIES, Precision

SCHEDULES = ("1f1b", "interleaved", "zb1", "zbv", "dualpipev")
CP_KINDS = ("ring", "allgather")
RECOMPUTES = ("none", "selective", "full")
KERNELS = {"trainer": BF16_MIXED, "megatron": BF16_MEGATRON, "deepseek": BF16_DEEPSEEK}  # `activations`' choices
NORMS = ("eager", "fused")  # RMSNorm's and the loss's kernels: over fp32 copies autograd keeps, or one fused kernel
SP_INPUTS = ("gathered", "sharded")  # what an SP column-parallel linear keeps of its input
# The fields that name one of a few kinds (`stack_from_dict` refuses any other value)
ONE_OF = {"grad_buffer": ("sharded", "full"), "activations": tuple(KERNELS), "norm": NORMS, "loss": NORMS,
          "selective": SELECTIVE_POLICIES, "sp_inputs": SP_INPUTS}
MAX_STACK_BYTES = 1 << 16  # a stack file is a few lines; anything larger is not one


@dataclass(frozen=True)
class Stack:
    name: str
    param_bytes: float = 2
    grad_bytes: float = 2
    master_bytes: float = 4
    optimizer_bytes: float = 8
    grad_buffer: str = "sharded"
    activations: str = "trainer"
    norm: str = ""  # "eager" or "fused"; "": as `activations`' kernels
    loss: str = ""  # the same for the cross-entropy
    selective: str = ""  # of `SELECTIVE_POLICIES`; "": "matmuls" for this trainer's kernels, else "core_attention"
    grad_copy_bytes: float = 0
    ddp_bucket_bytes: float = 0
    sp_inputs: str = ""  # "gathered" or "sharded"; "": as `activations`' kernels
    reserved_gib: float | None = None  # None: 10% of the chip's memory
    schedules: tuple[str, ...] = SCHEDULES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    cp: tuple[str, ...] = CP_KINDS
    recompute: tuple[str, ...] = RECOMPUTES
    max_tp: int = 0
    sequence_parallel: bool = True

    @property
    def precision(self) -> Precision:
        """The memory model's bytes per parameter and kernels (`rank_memory.Precision`)."""
        kernels = KERNELS[self.activations]
        return dataclasses.replace(kernels, param=self.param_bytes, grad=self.grad_bytes,
                                   optimizer=self.master_bytes + self.optimizer_bytes, master=self.master_bytes,
                                   grad_buffer=self.grad_buffer,
                                   fused_norm=None if not self.norm else self.norm == "fused",
                                   fused_loss=None if not self.loss else self.loss == "fused",
                                   selective=self.selective or kernels.selective, grad_copies=self.grad_copy_bytes,
                                   ddp_bucket=self.ddp_bucket_bytes,
                                   sp_regather=self.sp_inputs == "sharded" if self.sp_inputs else kernels.sp_regather)

    def reserved_bytes(self, memory_bytes: float) -> float:
        return 0.1 * memory_bytes if self.reserved_gib is None else self.reserved_gib * 2 ** 30


# Today's three `--kernels`: the same bytes per parameter (bf16 weights and gradients, fp32 master and moments;
# DeepSeek-V3's fp32 gradients and bf16 moments, §3.3.3) and kernels as `rank_memory`'s records.
PRESETS = {"trainer": Stack("trainer"), "megatron": Stack("megatron", activations="megatron"),
           "deepseek": Stack("deepseek", grad_bytes=4, optimizer_bytes=4, activations="deepseek")}


def _choices(path: str, key: str, value: Any, allowed: tuple) -> tuple:
    if not isinstance(value, list) or any(v not in allowed for v in value) or len(set(value)) != len(value):
        raise ValueError(f"{path}: {key} must be a list of distinct values of {list(allowed)}, got {value!r}")
    return tuple(value)


def _bytes(path: str, key: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= 64:
        raise ValueError(f"{path}: {key} must be a number of bytes in 0..64, got {value!r}")
    return value


def stack_from_dict(values: dict[str, Any], path: str) -> Stack:
    """A Stack from a TOML file's values, each checked (one-line ValueError naming the file and the key)."""
    fields = {f.name for f in dataclasses.fields(Stack)} - {"name"}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown stack field(s) {unknown}; known: {sorted(fields)}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key.endswith("_bytes"):
            out[key] = _bytes(path, key, value)
        elif key in ONE_OF and value not in ONE_OF[key]:
            raise ValueError(f"{path}: {key} must be one of {list(ONE_OF[key])}, got {value!r}")
        elif key == "reserved_gib" and (type(value) not in (int, float) or not math.isfinite(value)
                                        or not 0 <= value <= 1024):
            raise ValueError(f"{path}: reserved_gib must be a number of GiB in 0..1024, got {value!r}")
        elif key == "sequence_parallel" and type(value) is not bool:
            raise ValueError(f"{path}: sequence_parallel must be true or false, got {value!r}")
        elif key == "max_tp" and (type(value) is not int or not 0 <= value <= 1 << 16):
            raise ValueError(f"{path}: max_tp must be a whole number >= 0 (0: no limit), got {value!r}")
        elif key in ("schedules", "zero_stages", "cp", "recompute"):
            allowed = {"schedules": SCHEDULES, "zero_stages": (0, 1, 2, 3), "cp": CP_KINDS, "recompute": RECOMPUTES}
            out[key] = _choices(path, key, value, allowed[key])
            if key != "cp" and not out[key]:
                raise ValueError(f"{path}: {key} is empty; a stack runs at least one of {list(allowed[key])}")
        else:
            out[key] = value
    return Stack(Path(path).stem, **out)


def load_stack(name_or_path: str) -> Stack:
    """A preset (`PRESETS`) by name, else a stack TOML file, read as untrusted input."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--stack {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    if path.stat().st_size > MAX_STACK_BYTES:
        raise ValueError(f"--stack {path} is {path.stat().st_size:,} bytes; a stack file is a few lines")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--stack {path} is not TOML: {(str(e).splitlines() or ['unreadable'])[0]}") from None
    return stack_from_dict(values, str(path))


def stack_words(stack: Stack) -> str:
    """What the stack keeps and can run, in words (the planner's report)."""
    limits = [f"schedules {', '.join(stack.schedules)}" if stack.schedules != SCHEDULES else "",
              f"ZeRO {', '.join(map(str, stack.zero_stages))}" if stack.zero_stages != (0, 1, 2, 3) else "",
              ("no context parallelism" if not stack.cp else f"cp by {', '.join(stack.cp)}")
              if stack.cp != CP_KINDS else "",
              f"recompute {', '.join(stack.recompute)}" if stack.recompute != RECOMPUTES else "",
              f"tp <= {stack.max_tp}" if stack.max_tp else "",
              "" if stack.sequence_parallel else "no sequence parallelism"]
    runs = "; ".join(w for w in limits if w)
    return (f"stack {stack.name}: {stack.param_bytes:g} + {stack.grad_bytes:g} ({stack.grad_buffer}) + "
            f"{stack.master_bytes:g} + {stack.optimizer_bytes:g} bytes per parameter (weights, gradients, master, "
            f"optimizer), {stack.activations}'s kernels' activations" +
            (f" with {'an' if stack.norm == 'eager' else 'a'} {stack.norm} RMSNorm" if stack.norm else "") +
            (f", {'an' if stack.loss == 'eager' else 'a'} {stack.loss} loss" if stack.loss else "") +
            (f", selective recomputation keeping {stack.selective}" if stack.selective else "") +
            (f", SP inputs kept {stack.sp_inputs}" if stack.sp_inputs else "") +
            (f"; {stack.grad_copy_bytes:g} bytes per parameter of gradient copies and {stack.ddp_bucket_bytes:g} of "
             "DDP buckets beside the gradients" if stack.grad_copy_bytes or stack.ddp_bucket_bytes else "") +
            (f"; runs {runs}" if runs else ""))
