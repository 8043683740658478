"""The layout planner: `python -m minidist.plan --model llama3-405b --gpus 16384 --seq-len 8192
--global-batch-tokens 16M` lists the layouts that fit the chip's memory, fastest predicted first (chapter 12).

The command line of the layout search (`search`): its one-line errors for bad input before any search, and
`--explain` for one layout (`explain`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from minidist.flops import count_params
from minidist.hardware import GIB, MAMF_SOURCE, node_chips
from minidist.model.config import ALL_PRESETS, ModelConfig
from minidist.out_files import refuse_link, replace_file
from minidist.parallel.layout import Layout
from minidist.plan.cluster import DEFAULT_EFFICIENCY, Cluster, cluster_for_chip, fp8_rate
from minidist.plan.explain import evaluate, format_explain, parse_settings
from minidist.plan.gemm_table import MEASURE_ROWS, GemmTable, load_gemm_table, measure_gemm_table, model_gemm_grid
from minidist.plan.layout_rows import all_rows, explain_rows, read_layout_file
from minidist.plan.model_source import planned_model
from minidist.plan.mtp import with_mtp
from minidist.plan.rank_memory import PRECISIONS
from minidist.plan.restrict import of_stack, parse_restrict, with_micro_batch_size
from minidist.plan.search import (
    FP8_CHOICES,
    JSON_KEYS,
    Candidate,
    Plan,
    describe_layout,
    format_plan,
    global_batch_sequences,
    parse_tokens,
    rank_of,
    search,
)
from minidist.plan.stack import Stack, load_stack, stack_words
from minidist.plan.step_time import Recipe
from minidist.train.config import OneLineParser


def _add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The stack, the memory and the layouts a user can run (`plan.stack`, `plan.restrict`, `plan.layout_rows`)."""
    parser.add_argument("--stack", default=None, metavar="NAME|FILE.toml",
                        help="the training stack's memory rules and abilities: a preset, trainer (default: this "
                             "trainer's kernels, bf16 weights and gradients, fp32 master and moments), megatron "
                             "(Megatron-LM's kernels' saved activations: a fused RMSNorm, SP inputs kept sharded; bf16 "
                             "gradients sharded as ZeRO says: Megatron-Core's fp32 main_grad buffer is "
                             "configs/stacks/megatron-core.toml), "
                             "deepseek (DeepSeek-V3's: fp32 gradients, bf16 moments, FP8 saved inputs, norms, SwiGLU "
                             "and MLA's up-projections recomputed: needs --fp8), or a TOML file with the fields "
                             "param_bytes, grad_bytes, master_bytes (0: none), optimizer_bytes (e.g. 8: AdamW's fp32 "
                             "moments), grad_buffer (\"sharded\": follows ZeRO; \"full\": grad_bytes per parameter of "
                             "the rank's shard whatever the stage), grad_copy_bytes (gradients kept whole beside "
                             "those until the step), ddp_bucket_bytes (torch DDP's buckets, whole, where replicated), "
                             "sp_inputs (gathered|sharded: what an SP linear keeps of its input), activations "
                             "(trainer|megatron|deepseek), norm "
                             "(eager: RMSNorm keeps an fp32 copy; fused: its input; default: as activations), loss "
                             "(eager|fused: the cross-entropy's kernel), selective "
                             "(matmuls|alternate_matmuls|core_attention: what selective recomputation keeps), "
                             "reserved_gib (per GPU; default 10%% of its memory), and what it can run: schedules, "
                             "zero_stages, cp (its context-parallel kinds, [] for none), recompute, max_tp (0: any), "
                             "sequence_parallel (true/false); "
                             "see minidist/plan/stack.py and configs/stacks/")
    parser.add_argument("--kernels", default=None, choices=tuple(PRECISIONS),
                        help="the same as --stack with a preset name (kept for older commands)")
    parser.add_argument("--memory-gib", type=float, default=None, metavar="G",
                        help="memory per GPU in GiB instead of the chip's (the stack's reserved_gib comes off it)")
    parser.add_argument("--micro-batch-size", type=int, default=0, metavar="B",
                        help="sequences per micro-batch (the micro-batches follow from the global batch; a dp whose "
                             "dp x B does not divide it is refused); default: the search chooses")
    parser.add_argument("--restrict", default="", metavar="SETTINGS",
                        help='only layouts with these values, e.g. "zero=0,1 schedule=1f1b cp=1 recompute=none" '
                             "(keys dp, tp, pp, cp, ep, zero, microbatches, virtual_stages, schedule, recompute, "
                             "cp_impl; values separated by commas)")
    parser.add_argument("--all", action="store_true",
                        help="with --json: also the --top fastest layouts that do not fit, each with fits false; every "
                             "row with mem_per_stage_gib and, when it does not fit, overflow_term")
    parser.add_argument("--explain-file", metavar="FILE", default=None,
                        help="one layout per line in --explain's syntax (booleans 1/0 or true/false); prints one JSON "
                             "object per line (the row, mem_per_stage_gib, overflow_term, rank), one search for all")


def build_parser() -> argparse.ArgumentParser:
    presets = sorted(ALL_PRESETS)
    parser = OneLineParser(prog="python -m minidist.plan", description=__doc__.split("\n\n")[0].replace("`", ""),
                           epilog="Memory: minidist/plan/rank_memory.py; time: minidist/plan/step_time.py (what each "
                                  "leaves out is in its docstring). K, M, G are powers of two: 4M = 4,194,304 = 512 "
                                  "x 8192.")
    parser.add_argument("--model", default="llama3-8b", metavar="PRESET|FILE",
                        help=f"model preset ({', '.join(presets)}), a Hugging Face config.json (Llama/Mistral-style "
                             "dense, DeepSeek-V3-style MoE + MLA; keys that do not change the architecture ignored, "
                             "unmodelled ones refused: Qwen2's q/k/v biases, a sliding window) or a minidist TOML "
                             "model table ([model], optionally preset = NAME)")
    parser.add_argument("--set", action="append", default=[], metavar="model.FIELD=VALUE",
                        help="override a model field (TOML value), e.g. --set model.n_layers=80")
    parser.add_argument("--gpus", type=int, default=8, help="number of GPUs (default: 8)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink in one node (default: 8)")
    parser.add_argument("--gpu", default="H100-SXM", metavar="CHIP",
                        help=f"chip: {', '.join(node_chips())} (default: H100-SXM)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--global-batch-tokens", default="4M", metavar="B",
                        help="tokens per optimizer step, e.g. 4M (default: 4M = 4,194,304)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="layouts to list (default: 10)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="fraction of the bf16 peak the matmuls reach (default: the chip's published best matmul "
                             f"throughput, {MAMF_SOURCE}; {DEFAULT_EFFICIENCY} for a chip without one)")
    parser.add_argument("--json", action="store_true", help=f"print a JSON list of the top K, keys: "
                        f"{', '.join(JSON_KEYS)} (with --explain: one object, the same keys and 'rank')")
    parser.add_argument("--fp8", default="none", choices=FP8_CHOICES,
                        help="the blocks' linear GEMMs in FP8 with the trainer's recipe of that name (blockwise on "
                             "H800/H100 at DeepGEMM's rate measured at DeepSeek-V3's shapes, else the FP8 peak, twice "
                             "bf16's, at the bf16 efficiency; DeepSeek-V3 trained blockwise); default none")
    _add_stack_arguments(parser)
    parser.add_argument("--max-nodes", type=int, default=0, metavar="M",
                        help="node-limited routing: each token's experts on at most M nodes, as DeepSeek-V3's M=4 "
                             "(the network carries min(top_k, M) rows per token); default 0, unlimited")
    parser.add_argument("--comm-sms", type=int, default=0, metavar="N",
                        help="SMs the expert all-to-all's kernels hold beside DualPipeV's paired compute, as "
                             "DeepSeek-V3's 20 of the H800's 132 (the paired compute slows to the rest); default 0")
    parser.add_argument("--mtp-depth", type=int, default=None, metavar="D",
                        help="multi-token prediction's modules, each a block, a projection and a pass through the "
                             "head (DeepSeek-V3 trained with 1; the trainer has none); default 0, or a config.json's "
                             "num_nextn_predict_layers")
    parser.add_argument("--gemm-table", metavar="FILE", default=None,
                        help="the blocks' bf16 linears at the GEMM rates by shape FILE holds (written by "
                             "--measure-gemms on the chip planned for), not at one efficiency of the peak")
    parser.add_argument("--measure-gemms", metavar="FILE", default=None,
                        help="measure the GEMM rates of --model's linears by shape on this machine (CUDA in bf16, "
                             "else the CPU in fp32: every tp degree up to --gpus-per-node, 128 to 32,768 rows) and "
                             "write them to FILE; plan with --gemm-table FILE")
    parser.add_argument("--measure-seconds", type=float, default=0.05, metavar="S",
                        help="--measure-gemms: seconds of timing per shape, after a warm-up call (default 0.05)")
    parser.add_argument("--explain", metavar="SETTINGS", default=None,
                        help='one layout in detail, e.g. "dp=128 tp=8 pp=16 cp=1 ep=1" (any Layout.of setting; the '
                             "rest as the search would choose them): memory per pipeline stage, step time by term, "
                             "its rank")
    return parser


def _explain(cfg: ModelConfig, plan: Plan, settings: dict, args: argparse.Namespace, seq_len: int, tokens: int,
             cluster: Cluster, stack: Stack) -> int:
    """--explain: the fastest layout of the search with `settings` (or that layout evaluated as given)."""
    sequences = global_batch_sequences(tokens, seq_len)
    if plan.precision.fp8_saved and settings.get("recompute") == "selective":
        raise ValueError("--explain recompute=selective: DeepSeek-V3's kernels recompute their own parts (norms, "
                         "SwiGLU, MLA's up-projections); choose recompute=none or recompute=full")
    planned = with_mtp(cfg, plan.recipe.mtp_depth)  # the model as the search planned it
    rank, c = rank_of(plan, **settings)
    if c is None:
        layout = Layout.of(**settings)
        c = Candidate(layout, *evaluate(planned, layout, seq_len, sequences, cluster, plan.precision, plan.recipe))
    if args.json:
        print(json.dumps({**c.row(), "rank": rank}))
    else:
        print(format_plan(plan, args.model, cfg, args.gpus, seq_len, tokens, cluster, 1))
        print(f"{stack_words(stack)}; usable per GPU: {cluster.memory_bytes / GIB:.1f} GiB - reserved "
              f"{stack.reserved_bytes(cluster.memory_bytes) / GIB:.1f} GiB = {cluster.budget / GIB:.1f} GiB")
        print("")
        print(format_explain(planned, c.layout, describe_layout(c.layout), c.time, c.fits, rank, len(plan.feasible),
                             seq_len, sequences, plan.precision, plan.budget, plan.recipe.mtp_depth))
    return 0


def gpu_table(table: GemmTable) -> GemmTable:
    """`table`, unless it was measured on a CPU: the command line plans GPUs (one-line ValueError)."""
    if table.device.startswith("cpu"):
        raise ValueError(f"--gemm-table {table.source} was measured on a CPU ({table.device}); measure the GPU you "
                         "plan for with --measure-gemms on it")
    return table


def _measure_gemms(cfg: ModelConfig, gpus_per_node: int, path: Path, seconds: float) -> int:
    """--measure-gemms: every shape `model_gemm_grid` lists, timed on this machine's device, written to `path`."""
    if not 0 < seconds <= 60:
        raise ValueError(f"--measure-seconds must be in (0, 60], got {seconds}")
    if path.is_dir():
        raise ValueError(f"--measure-gemms {path} is a directory; name the table's file")
    refuse_link(path.parent)  # before minutes of timing; replace_file checks again when it writes
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tps = [tp for tp in range(1, gpus_per_node + 1) if cfg.n_heads % tp == 0]
    shapes = model_gemm_grid(cfg, tps, MEASURE_ROWS)
    print(f"measuring {len(shapes)} GEMM shapes on {device.type} in {dtype} (tp {tps}, rows {MEASURE_ROWS[0]} to "
          f"{MEASURE_ROWS[-1]})", file=sys.stderr)
    table = measure_gemm_table(shapes, device, dtype, seconds, progress=lambda line: print(line, file=sys.stderr))
    replace_file(path, table.to_json().encode())
    print(f"wrote {path}: {len(table.rates)} shapes measured on {table.device}")
    return 0


def _stack(args: argparse.Namespace) -> Stack:
    """--stack, or its alias --kernels (one of them)."""
    if args.kernels is not None and args.stack is not None and args.kernels != args.stack:
        raise ValueError(f"--kernels {args.kernels} and --stack {args.stack} disagree; give one (--kernels is "
                         "--stack's old name)")
    return load_stack(args.stack or args.kernels or "trainer")


def _check_numbers(args: argparse.Namespace) -> None:
    if args.gpu not in node_chips():
        raise ValueError(f"--gpu {args.gpu!r} is unknown; choose one of {node_chips()}")
    if args.max_nodes < 0:
        raise ValueError(f"--max-nodes must be >= 0 (0: unlimited), got {args.max_nodes}")
    for name in ("gpus", "gpus_per_node", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if args.memory_gib is not None and not 0 < args.memory_gib <= 1 << 20:
        raise ValueError(f"--memory-gib must be in (0, 1048576], got {args.memory_gib}")
    if args.all and not args.json:
        raise ValueError("--all lists the layouts that do not fit as JSON rows: add --json (the text report names "
                         "the fastest three and why)")
    if args.micro_batch_size < 0:
        raise ValueError(f"--micro-batch-size must be >= 1 sequences, got {args.micro_batch_size}")


def stack_cluster(cluster: Cluster, stack: Stack, memory_gib: float | None = None) -> Cluster:
    """`cluster` with `memory_gib` per GPU (default the chip's) less the stack's reserved GiB usable."""
    memory = cluster.memory_bytes if memory_gib is None else memory_gib * GIB
    reserved = stack.reserved_bytes(memory)
    if reserved >= memory:
        raise ValueError(f"the stack {stack.name} reserves {reserved / GIB:.1f} GiB of the {memory / GIB:.1f} GiB per "
                         "GPU: nothing is left for a layout")
    return dataclasses.replace(cluster, memory_bytes=memory, usable_memory=1 - reserved / memory)


def _settings_with_b(settings: dict, b: int, sequences: int) -> dict:
    """--explain's settings with the micro-batches that --micro-batch-size B implies for its dp."""
    if not b or "dp" not in settings or "microbatches" in settings:
        return settings
    if sequences % (settings["dp"] * b):
        raise ValueError(f"--micro-batch-size {b} with dp={settings['dp']}: dp x B = {settings['dp'] * b} does not "
                         f"divide the {sequences} sequences of the global batch")
    return {**settings, "microbatches": sequences // (settings["dp"] * b)}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_numbers(args)
        cfg, config_mtp = planned_model(args.model, args.set)
        stack = _stack(args)
        seq_len = args.seq_len or cfg.max_seq_len
        tokens = parse_tokens(args.global_batch_tokens)
        if args.measure_gemms is not None:
            return _measure_gemms(cfg, args.gpus_per_node, Path(args.measure_gemms), args.measure_seconds)
        cluster = stack_cluster(cluster_for_chip(args.gpu, args.gpus_per_node, args.efficiency), stack,
                                args.memory_gib)
        if args.gemm_table is not None:
            cluster = dataclasses.replace(cluster, gemm_table=gpu_table(load_gemm_table(args.gemm_table)))
        sequences = global_batch_sequences(tokens, seq_len)
        if args.micro_batch_size and sequences % args.micro_batch_size:
            raise ValueError(f"--micro-batch-size {args.micro_batch_size} does not divide the {sequences} sequences of "
                             "the global batch: no dp x B can")
        settings = parse_settings(args.explain) if args.explain is not None else None
        settings = settings and _settings_with_b(settings, args.micro_batch_size, sequences)
        layouts = read_layout_file(args.explain_file) if args.explain_file is not None else None
        restrict = with_micro_batch_size(of_stack(stack).joined(parse_restrict(args.restrict)), args.micro_batch_size)
        if args.fp8 != "none":
            fp8_rate(cluster, args.fp8)  # a chip without FP8: refused before the search
        mtp_depth = config_mtp if args.mtp_depth is None else args.mtp_depth
        plan = search(cfg, args.gpus, seq_len, tokens, cluster, stack.precision,
                      Recipe("" if args.fp8 == "none" else args.fp8, args.max_nodes, args.comm_sms, mtp_depth),
                      restrict)
        planned = with_mtp(cfg, mtp_depth)
        if layouts is not None:
            layouts = [(n, _settings_with_b(s, args.micro_batch_size, sequences)) for n, s in layouts]
            for row in explain_rows(planned, plan, layouts, args.gpus, seq_len, sequences, cluster):
                print(json.dumps(row))
            return 0
        if settings is not None:
            return _explain(cfg, plan, settings, args, seq_len, tokens, cluster, stack)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        rows = all_rows(planned, plan, seq_len, sequences, args.top) if args.all else \
            [c.row() for c in plan.feasible[:args.top]]
        print(json.dumps(rows))
    else:
        print(f"{args.model}: {count_params(cfg):,} parameters ({stack_words(stack)}; "
              f"{cluster.memory_bytes / GIB:.1f} GiB per GPU, {stack.reserved_bytes(cluster.memory_bytes) / GIB:.1f} "
              "reserved)")
        print(format_plan(plan, args.model, cfg, args.gpus, seq_len, tokens, cluster, args.top))
    return 0
