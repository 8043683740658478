"""The planner as a person uses it (chapter 12): any model (a config.json, a TOML model table, --set), a stack's
memory rules as data, the layouts a stack can run (--restrict, --micro-batch-size), many layouts in one process
(--explain-file), the layouts that do not fit (--json --all); hostile input answered in one line, quickly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from minidist.flops import count_params
from minidist.model import get_preset
from minidist.model.transformer import Transformer
from minidist.parallel import Layout
from minidist.plan.cli import main
from minidist.plan.model_source import planned_model
from minidist.plan.rank_memory import PRECISIONS, model_state_bytes, rank_params
from minidist.plan.stack import PRESETS, load_stack

SMALL = ["--gpus", "8", "--seq-len", "256", "--global-batch-tokens", "64K"]
LLAMA_1B = {  # Llama 3.2 1B's config.json: tied embeddings, GQA, with the keys that change nothing
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": True,
    "pretraining_tp": 1, "initializer_range": 0.02,
}
DEEPSEEK_SMALL = {  # DeepSeek-V3's config.json fields, its shapes shrunk
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 8, "n_shared_experts": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 4096}, "quantization_config": {"quant_method": "fp8"},
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "aux_loss_alpha": 0.001,
}


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _meta_count(cfg) -> int:
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once


@pytest.mark.parametrize("config", [LLAMA_1B, DEEPSEEK_SMALL, {**LLAMA_1B, "model_type": "mistral",
                                                                "tie_word_embeddings": False, "sliding_window": None,
                                                                "num_key_value_heads": 32}])
def test_a_config_json_is_planned_and_counted_as_the_model_built_on_meta(tmp_path, capsys, config):
    path = _write(tmp_path, "config.json", json.dumps(config))
    cfg, mtp = planned_model(path)
    assert count_params(cfg) == _meta_count(cfg)
    assert cfg.tie_embeddings == config["tie_word_embeddings"] and cfg.n_kv_heads == config["num_key_value_heads"]
    assert cfg.vocab_size == config["vocab_size"] and cfg.d_ff == config["intermediate_size"]
    assert mtp == config.get("num_nextn_predict_layers", 0)
    fp8 = ["--stack", "deepseek", "--fp8", "blockwise"] if config is DEEPSEEK_SMALL else []
    assert main(["--model", path, *SMALL, "--top", "1", *fp8]) == 0
    assert f"{count_params(cfg):,} parameters" in capsys.readouterr().out
    assert planned_model(str(tmp_path)) == (cfg, mtp)  # the checkpoint's directory names its config.json


def test_a_toml_model_table_and_set_override_a_preset(tmp_path, capsys):
    path = _write(tmp_path, "m.toml", '[model]\npreset = "tiny"\nn_layers = 6\n')
    cfg, _ = planned_model(path, ["model.d_ff=512", "model.tie_embeddings=true"])
    assert (cfg.n_layers, cfg.d_ff, cfg.tie_embeddings, cfg.d_model) == (6, 512, True, 128)
    assert count_params(cfg) == _meta_count(cfg)


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "qwen2"}, "q/k/v projections carry biases"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window attention is not modelled"),
    ({"attention_bias": True}, "attention_bias=True is not modelled"),
    ({"num_hidden_layers": 10**12}, "is more than 4096"),
    ({"hidden_size": 2**40}, "d_model=1,099,511,627,776 is more than"),
    ({"vocab_size": -5}, "vocab_size must be a positive integer"),
])
def test_hostile_or_unmodelled_configs_are_one_line(tmp_path, capsys, change, needle):
    path = _write(tmp_path, "config.json", json.dumps({**LLAMA_1B, "head_dim": None, **change}))
    start = time.monotonic()
    assert main(["--model", path, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert time.monotonic() - start < 20  # no hang (a loaded machine included)


def test_presets_are_todays_kernels_and_a_full_grad_buffer_costs_memory(tmp_path, capsys):
    assert {name: stack.precision for name, stack in PRESETS.items()} == PRECISIONS
    full = _write(tmp_path, "full.toml", 'grad_buffer = "full"\ngrad_bytes = 4\nzero_stages = [2]\n')
    cfg, layout = get_preset("llama3-8b"), Layout.of(dp=8, zero=2)
    n = sum(rank_params(cfg, layout).values())
    states = {s: model_state_bytes(cfg, layout, load_stack(s).precision) for s in ("trainer", full)}
    assert states["trainer"]["grads"] == 2 * n / 8 and states[full]["grads"] == 4 * n  # every parameter, not 1/dp
    assert states[full]["optimizer"] == states["trainer"]["optimizer"] == 12 * n / 8
    assert main(["--model", "tiny", *SMALL, "--stack", full, "--restrict", "dp=8", "--json"]) == 0
    assert {r["zero"] for r in json.loads(capsys.readouterr().out)} == {2}  # what the stack can run
    assert load_stack(full).precision.grad_buffer == "full"


STACKS = Path(__file__).resolve().parents[1] / "configs" / "stacks"


@pytest.mark.parametrize("name", sorted(p.name for p in STACKS.glob("*.toml")))
def test_every_shipped_stack_file_loads_and_plans(name, capsys):
    stack = load_stack(str(STACKS / name))
    fp8 = ["--fp8", "blockwise"] if stack.precision.fp8_saved else []
    assert main(["--model", "tiny", *SMALL, "--stack", str(STACKS / name), "--top", "1", *fp8]) == 0, name
    assert "layouts fit" in capsys.readouterr().out


def test_nanotrons_gradients_are_whole_under_zero1_with_their_copies():
    """nanotron's FP32GradientAccumulator keeps a buffer for every parameter of the rank's shard, "even when Zero 1
    is used", beside autograd's bf16 .grad and, with replicas, torch DDP's buckets; its fp32 master copy and moments
    follow ZeRO-1."""
    cfg, nanotron = get_preset("llama3-8b"), load_stack(str(STACKS / "nanotron.toml")).precision
    for dp, grads in ((8, 4 + 2 + 2), (1, 4 + 2)):  # no DDP (and no bucket) without replicas
        layout = Layout.of(dp=dp, tp=8 // dp, zero=1 if dp > 1 else 0)
        n = sum(rank_params(cfg, layout).values())
        states = model_state_bytes(cfg, layout, nanotron)
        assert states == {"params": 2 * n, "grads": grads * n, "optimizer": 12 * n / dp}, dp


def test_sp_inputs_kept_sharded_save_the_gathered_copies(tmp_path):
    """sp_inputs = "sharded" (Megatron-LM's, nanotron's tp_recompute_allgather): each of a block's two column-parallel
    regions and the head keep 1/tp of their input instead of the gathered whole."""
    from minidist.plan.rank_memory import activation_bytes
    cfg, layout = get_preset("llama3-8b"), Layout.of(dp=2, tp=4, sequence_parallel=True)
    kept = {k: load_stack(_write(tmp_path, f"{k}.toml", f'sp_inputs = "{k}"\n')).precision
            for k in ("gathered", "sharded")}
    gathered, sharded = (activation_bytes(cfg, layout, 4096, 2, kept[k])[0] for k in ("gathered", "sharded"))
    assert gathered == activation_bytes(cfg, layout, 4096, 2, PRESETS["trainer"].precision)[0]
    assert gathered - sharded == pytest.approx((2 * cfg.n_layers + 1) * 2 * (2 * 4096) * cfg.d_model * (1 - 1 / 4))


@pytest.mark.parametrize("text, needle", [
    ("grad_bytes = -2\n", "grad_bytes must be a number of bytes in 0..64"),
    ("grad_buffer = \"half\"\n", "grad_buffer must be"),
    ("schedules = [\"gpipe\"]\n", "schedules must be a list"),
    ("colour = 1\n", "unknown stack field(s) ['colour']"),
    ("reserved_gib = 90\n", "nothing is left for a layout"),
    ("norm = \"apex\"\n", "norm must be one of ['eager', 'fused']"),
    ("sp_inputs = \"half\"\n", "sp_inputs must be one of ['gathered', 'sharded']"),
    ("ddp_bucket_bytes = 1e9\n", "ddp_bucket_bytes must be a number of bytes in 0..64"),
])
def test_bad_stack_files_are_one_line(tmp_path, capsys, text, needle):
    assert main(["--model", "tiny", *SMALL, "--stack", _write(tmp_path, "s.toml", text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_fused_norm_keeps_its_input_not_an_fp32_copy(tmp_path):
    """torchtitan's 13B preset of 2024 (a Triton RMSNorm) with this trainer's other kernels: each of a block's two
    norms and the head's keeps d fp32 values per token fewer (its bf16 input and 1/rms, not x.float() beside them)."""
    from minidist.plan.rank_memory import activation_bytes
    cfg, layout = get_preset("llama3-8b"), Layout.of(dp=8, zero=3)
    stacks = {norm: load_stack(_write(tmp_path, f"{norm}.toml", f'norm = "{norm}"\n')) for norm in ("eager", "fused")}
    eager, fused = (activation_bytes(cfg, layout, 4096, 2, stacks[k].precision)[0] for k in ("eager", "fused"))
    assert eager == activation_bytes(cfg, layout, 4096, 2, PRESETS["trainer"].precision)[0]  # the trainer's norm
    assert eager - fused == (2 * cfg.n_layers + 1) * 4 * (2 * 4096) * cfg.d_model
    megatron = load_stack(_write(tmp_path, "m.toml", 'activations = "megatron"\nnorm = "eager"\n')).precision
    assert megatron.fused and megatron.fused_norm is False and PRESETS["megatron"].precision.fused_norm is None


def test_restrict_and_micro_batch_size_bound_every_layout(capsys):
    argv = ["--model", "tiny", *SMALL, "--json", "--top", "50", "--micro-batch-size", "4",
            "--restrict", "zero=0,1 schedule=1f1b cp=1 recompute=none"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["zero"] in (0, 1) and r["cp"] == 1 and r["recompute"] == "none" for r in rows)
    assert all(r["schedule"] == "1f1b" and r["dp"] * 4 * r["microbatches"] == 256 for r in rows)
    assert main(["--model", "tiny", *SMALL, "--micro-batch-size", "64", "--explain", "dp=8"]) == 2
    assert "dp x B = 512 does not divide the 256 sequences" in capsys.readouterr().err
    assert main(["--model", "tiny", *SMALL, "--micro-batch-size", "3"]) == 2
    assert "--micro-batch-size 3 does not divide the 256 sequences" in capsys.readouterr().err


def test_tp_beyond_a_node_is_searched_where_nothing_inside_one_fits(capsys):
    argv = ["--model", "llama2-7b", "--gpus", "8", "--gpus-per-node", "1", "--seq-len", "4096",
            "--global-batch-tokens", "32K", "--restrict", "pp=1 cp=1 zero=0", "--memory-gib", "40", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["tp"] > 1 for r in rows)  # tp 1 does not fit 40 GiB; tp over the network does


def test_explain_file_answers_each_line_as_explain_does(tmp_path, capsys):
    lines = ["dp=8 tp=1 pp=1", "dp=2 tp=2 pp=2 zero=1  # a comment", "", "dp=1 tp=4 pp=2 sequence_parallel=1"]
    path = _write(tmp_path, "layouts.txt", "\n".join(lines))
    assert main(["--model", "tiny", *SMALL, "--explain-file", path]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 4] and rows[1]["zero"] == 1
    assert all(len(r["mem_per_stage_gib"]) == r["pp"] for r in rows)
    assert main(["--model", "tiny", *SMALL, "--explain", lines[1].split("#")[0], "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert {k: single[k] for k in ("step_s", "mem_gib", "rank")} == {k: rows[1][k] for k in ("step_s", "mem_gib",
                                                                                              "rank")}


@pytest.mark.parametrize("text, needle", [
    ("\n" * 1_000_000, "at most 10,000 layouts"),
    ("dp=8 tp=x\n", "line 1"),
    ("# nothing\n", "holds no layout"),
    ("dp=8 schedule=foo\n", "schedule='foo' is unknown"),
    ("dp=1 tp=8\n", "tp=8 must divide the 4 heads"),
    ("dp=4 tp=4\n", "dp·tp·pp·cp = 16, not the 8 GPUs"),
    ("dp=2 tp=1 pp=4\ndp=2 pp=4 schedule=zb1 microbatches=1\n", "line 2: zb1 needs microbatches >= pp"),
])
def test_hostile_layout_files_are_one_line_without_a_hang(tmp_path, capsys, text, needle):
    start = time.monotonic()
    assert main(["--model", "tiny", *SMALL, "--explain-file", _write(tmp_path, "f.txt", text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert time.monotonic() - start < 20


def test_json_all_lists_what_does_not_fit_and_why(capsys):
    assert main(["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "256K",
                 "--json", "--all", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    over = [r for r in rows if not r["fits"]]
    assert len(over) == 3 and len(rows) == 6
    for r in over:
        assert len(r["mem_per_stage_gib"]) == r["pp"] and max(r["mem_per_stage_gib"]) == r["mem_gib"] > 72
        assert r["overflow_term"] in ("params", "grads", "optimizer", "activations", "recompute_transient")


def test_a_stack_without_sequence_parallelism_keeps_whole_activations(tmp_path, capsys):
    from minidist.model import get_preset as preset
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.restrict import of_stack
    from minidist.plan.search import search
    no_sp = load_stack(_write(tmp_path, "nosp.toml", "sequence_parallel = false\n"))
    plans = {name: search(preset("tiny"), 8, 256, 64 * 1024, cluster_for_chip("H100-SXM"), stack.precision,
                          restrict=of_stack(stack)) for name, stack in (("sp", PRESETS["trainer"]), ("no", no_sp))}
    tp = [c for c in plans["no"].feasible if c.layout.dims.tp > 1]
    assert tp and not any(c.layout.options.sequence_parallel for c in tp)
    def key(c):  # the layout but for sequence parallelism
        return tuple((k, v) for k, v in c.layout.flat().items() if k != "sequence_parallel")
    with_sp = {key(c): c for c in plans["sp"].feasible}
    pairs = [(c, with_sp[key(c)]) for c in tp if key(c) in with_sp]
    assert pairs and all(a.memory.activations > b.memory.activations for a, b in pairs)
    assert main(["--model", "tiny", *SMALL, "--kernels", "megatron", "--stack", "trainer"]) == 2
    assert "disagree" in capsys.readouterr().err


def test_explain_shows_every_memory_term_of_the_stack(capsys):
    assert main(["--model", "tiny", *SMALL, "--stack", "megatron", "--memory-gib", "40",
                 "--explain", "dp=2 tp=2 pp=2"]) == 0
    out = capsys.readouterr().out
    for term in ("params", "grads", "master", "optim", "acts", "recomp"):
        assert f" {term} " in out.split("memory per rank by pipeline stage")[1].splitlines()[1] + " ", term
    assert "40.0 GiB - reserved 4.0 GiB = 36.0 GiB" in out  # --memory-gib, the default reserve of 10%
    assert "master + optim: 4 + 8 bytes per parameter" in out
    assert main(["--model", "tiny", *SMALL, "--all"]) == 2
