"""Hugging Face Llama checkpoints in and out (minidist.convert.runs): the converted model computes HF's logits, the
round trip minidist -> HF -> minidist is bit for bit, the file formats HF writes are read, hostile input is refused in
one line. The reference is transformers' LlamaForCausalLM (the `bench` extra), built from the written directory with
nothing downloaded."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the reference is built from local files only

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

from minidist.comm.launch import run_ranks  # noqa: E402
from minidist.convert import hf_files, hf_tokenizer  # noqa: E402
from minidist.convert.hf_model import ConvertError, from_hf_state, to_hf_state  # noqa: E402
from minidist.convert.runs import main, read_hf  # noqa: E402
from minidist.data.corpus import BatchSampler, load_corpus  # noqa: E402
from minidist.data.tokenizer import from_tokenizer  # noqa: E402
from minidist.model import build_model, get_preset, lm_loss  # noqa: E402
from minidist.train import loop as train
from minidist.train.config import TrainConfig, model_config, parse_config  # noqa: E402
from minidist.train.reshard import read_full_model  # noqa: E402

# The converted model's logits equal HF's to this (fp32: the same products summed in another order; measured
# max |diff| 5e-7 on logits of magnitude ~1).
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)

# GQA (8 query heads share 2 kv heads) stored in the interleaved RoPE layout (q/k rows permuted on the way), tied
# embeddings, YaRN context extension exercised at positions past the original 64.
GQA = dict(d_model=64, n_heads=8, n_kv_heads=2, n_layers=2, d_ff=96, max_seq_len=128, rope_layout="interleaved",
           tie_embeddings=True, rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_seq_len": 32})
CONFIGS = {"tiny": {}, "gqa interleaved tied yarn": GQA,
           "mqa linear": dict(d_model=64, n_heads=4, n_kv_heads=1, n_layers=1, d_ff=64, rope_base=500000.0,
                              rope_scaling={"kind": "linear", "factor": 2.0})}


def hf_logits(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    ref = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return ref(input_ids=tokens).logits


def tokens_for(cfg, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_logits_and_bitwise_round_trip(name, tmp_path, one_thread):
    cfg = get_preset("tiny", **CONFIGS[name])
    model = build_model(cfg, seed=3).eval()
    state = model.state_dict()
    hf_config, hf_state = to_hf_state(cfg, state)
    hf_files.write_hf_dir(tmp_path / "hf", hf_config, hf_state)

    tokens = tokens_for(cfg)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", tokens), ours, **LOGIT_TOL)

    back_cfg, back = read_hf(tmp_path / "hf", rope_layout=cfg.rope_layout)
    assert back_cfg == cfg
    assert set(back) == set(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_interleaved_layout_is_permuted(one_thread):
    """The same weights read as "half" and as "interleaved" differ exactly by chapter 03's permutation of q and k,
    and compute the same logits."""
    cfg = get_preset("tiny", **{**GQA, "rope_layout": "half", "rope_scaling": {}})
    hf_config, hf_state = to_hf_state(cfg, build_model(cfg, seed=1).state_dict())
    _, half = from_hf_state(hf_config, hf_state, "half")
    icfg, inter = from_hf_state(hf_config, hf_state, "interleaved")
    assert not torch.equal(half["blocks.0.attn.wq.weight"], inter["blocks.0.attn.wq.weight"])
    assert torch.equal(half["blocks.0.attn.wv.weight"], inter["blocks.0.attn.wv.weight"])
    models = []
    for c, s in ((cfg, half), (icfg, inter)):
        m = build_model(c).eval()
        m.load_state_dict(s)
        models.append(m)
    tokens = tokens_for(cfg, 1)
    with torch.no_grad():
        torch.testing.assert_close(models[0](tokens), models[1](tokens), **LOGIT_TOL)


def test_reads_torch_bin_and_sharded_safetensors(tmp_path):
    """pytorch_model.bin (torch.save of a state dict, transformers 4.x) and a sharded model.safetensors.index.json
    read back as the same tensors, in bf16 too (converted to fp32 exactly); a derived rotary buffer is skipped."""
    cfg = get_preset("tiny", n_layers=2)
    hf_config, hf_state = to_hf_state(cfg, build_model(cfg).state_dict())
    bf16 = {k: v.to(torch.bfloat16) for k, v in hf_state.items()}
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(hf_config))
    torch.save({**bf16, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)},
               tmp_path / "bin" / "pytorch_model.bin")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(hf_config))
    names = sorted(hf_state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: hf_state[k] for k in part}, str(shards / file))
        weight_map.update({k: file for k in part})
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    _, from_bin = read_hf(tmp_path / "bin")
    _, from_shards = read_hf(shards)
    for key, value in from_hf_state(hf_config, hf_state)[1].items():
        assert torch.equal(from_shards[key], value), key
        assert torch.equal(from_bin[key], value.to(torch.bfloat16).float()), key


# ---------------------------------------------------------------------------------------------------------------
# refusals: one line each, naming what is wrong


def _small():
    cfg = get_preset("tiny", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=32)
    return to_hf_state(cfg, build_model(cfg).state_dict())


def _config(**changes):
    hf_config, hf_state = _small()
    return {**hf_config, **changes}, hf_state


def _state(fn):
    hf_config, hf_state = _small()
    fn(hf_state)
    return hf_config, hf_state


BAD = {
    "not llama": (_config(model_type="gpt2"), "model_type is 'gpt2'"),
    "bias": (_config(attention_bias=True), "attention_bias=True is not supported"),
    "activation": (_config(hidden_act="gelu"), "hidden_act='gelu'"),
    "dropout": (_config(attention_dropout=0.1), "attention_dropout=0.1"),
    "rope llama3": (_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
                    "rope_type 'llama3' is not supported"),
    "yarn attention factor": (_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                       "attention_factor": 1.5}), "['attention_factor']"),
    "heads": (_config(num_attention_heads=3), "heads do not divide"),
    "kv heads": (_config(num_key_value_heads=3), "heads do not divide"),
    "head_dim": (_config(head_dim=16), "head_dim 16 is not supported"),
    "negative": (_config(num_hidden_layers=-1), "num_hidden_layers must be a positive integer"),
    "float size": (_config(hidden_size=32.0), "hidden_size must be a positive integer"),
    "layers": (_config(num_hidden_layers=10**9), "num_hidden_layers=1000000000 is more than 4096"),
    "missing": (_state(lambda s: s.pop("model.layers.0.mlp.up_proj.weight")),
                "1 missing (e.g. ['model.layers.0.mlp.up_proj.weight'])"),
    "extra": (_state(lambda s: s.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(32, 32)})),
              "1 unexpected (e.g. ['model.layers.1.mlp.up_proj.weight'])"),
    "untied without lm_head": (_state(lambda s: s.pop("lm_head.weight")), "untied embeddings need lm_head"),
    "tied but different": (
        (lambda c, s: ({**c, "tie_word_embeddings": True}, s))(*_small()), "lm_head.weight differs"),
    "shape": (_state(lambda s: s.update({"model.norm.weight": torch.ones(33)})),
              "model.norm.weight has shape [33]; the config implies [32]"),
    "dtype": (_state(lambda s: s.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)})),
              "dtype torch.int32"),
    "nan": (_state(lambda s: s["model.norm.weight"].__setitem__(0, float("nan"))), "NaN or infinite"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_checkpoints_are_refused_in_one_line(name):
    (hf_config, hf_state), words = BAD[name]
    with pytest.raises(ConvertError) as e:
        from_hf_state(hf_config, hf_state)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_non_llama_models_are_refused_on_the_way_out():
    for changes, words in ((dict(mlp="gelu"), "mlp='gelu'"), (dict(moe={"n_experts": 4}), "mixture-of-experts"),
                           (dict(rope_scaling={"kind": "ntk", "factor": 2.0}), "'ntk' has no HF Llama")):
        cfg = get_preset("tiny", n_layers=1, **changes)
        with pytest.raises(ConvertError, match=words):
            to_hf_state(cfg, build_model(cfg).state_dict())


def _write(path, files: dict):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def test_bad_directories_are_refused_in_one_line(tmp_path):
    hf_config, hf_state = _small()
    config = json.dumps(hf_config)

    class Evil:  # what weights_only=True must refuse to rebuild
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.bin")
    save_file({"model.norm.weight": torch.ones(33)}, str(tmp_path / "wrong.safetensors"))
    cases = {
        "absent": (None, "is not a directory"),
        "no config": ({"model.safetensors": b""}, "config.json is missing"),
        "bad json": ({"config.json": "{", "model.safetensors": b""}, "is not valid JSON"),
        "no weights": ({"config.json": config}, "holds no weights"),
        "pickle": ({"config.json": config, "pytorch_model.bin": (tmp_path / "evil.bin").read_bytes()},
                   "not a plain torch state dict"),
        "garbage safetensors": ({"config.json": config, "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}"},
                                "not a valid safetensors file"),
        "shape in header": ({"config.json": config, "model.safetensors": (tmp_path / "wrong.safetensors")
                            .read_bytes()}, "model.norm.weight has shape [33]"),
        "index escapes": ({"config.json": config, "model.safetensors.index.json":
                           json.dumps({"weight_map": {"model.norm.weight": "../secret.safetensors"}})},
                          "plain .safetensors file names"),
    }
    for name, (files, words) in cases.items():
        path = tmp_path / name.replace(" ", "_")
        if files is not None:
            _write(path, files)
        with pytest.raises(ConvertError) as e:
            read_hf(path)
        assert words in str(e.value) and "\n" not in str(e.value), name
    with pytest.raises(ConvertError, match="not an empty directory"):
        hf_files.write_hf_dir(tmp_path / "no_weights", hf_config, hf_state)  # holds config.json: never replaced


# ---------------------------------------------------------------------------------------------------------------
# the command line, with the trainer's checkpoints: to-hf of a dp2 x tp2 run, from-hf fine-tuned by --resume

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 32}


def run_config(out, **changes) -> TrainConfig:
    """One step of batch 4 x 32, checkpointed at its end."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=50_000, batch_size=4, seq_len=32, steps=1,
                    warmup_steps=0, eval_every=0, eval_batches=1, log_every=100, ckpt_every=1, out=str(out),
                    peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def test_to_hf_from_a_dp2_tp2_checkpoint(tmp_path, one_thread, capsys):
    """The HF model converted from a dp2 x tp2 run's checkpoint computes the logits of the one-process run's model
    (same seed and batch), and reads back as the checkpoint's full model bit for bit."""
    # train.train itself is the rank function: rank processes import minidist only, not this module's transformers
    run_ranks(train.train, 4, run_config(tmp_path / "dp2tp2", dp=2, tp=2), timeout=300, threads_per_rank=1,
              case="dp2 x tp2, 1 step")
    train.train(run_config(tmp_path / "single"))
    (tmp_path / "dp2tp2" / "tokenizer.json").unlink(missing_ok=True)  # a run from before the trainer wrote one
    capsys.readouterr()
    assert main(["to-hf", str(tmp_path / "dp2tp2"), str(tmp_path / "hf")]) == 0
    note = capsys.readouterr().err.splitlines()  # said in one line, the weights written alone
    assert len(note) == 1 and "tokenizer.json is missing" in note[0] and "weights only" in note[0], note
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    _check_tokenizer_beside_weights(tmp_path / "single", tmp_path, capsys)

    step_dir = tmp_path / "dp2tp2" / "checkpoints" / "step_000001"
    full = read_full_model(step_dir)
    cfg, state = read_hf(tmp_path / "hf")
    assert cfg == model_config(run_config("unused"))
    assert all(torch.equal(state[k], full[k]) for k in full) and set(state) == set(full)

    single = build_model(cfg).eval()
    single.load_state_dict(read_full_model(tmp_path / "single" / "checkpoints" / "step_000001"))
    tokens = tokens_for(cfg)
    with torch.no_grad():
        want = single(tokens)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", tokens), want, **LOGIT_TOL)


def small_bpe() -> Tokenizer:
    """A BPE trained here on two sentences (at most 120 ids), with an end-of-text special token."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 10
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"],
                                                      show_progress=False))
    return tok


def _check_tokenizer_beside_weights(run, tmp_path, capsys) -> None:
    """to-hf writes RUN_OUT/tokenizer.json beside the weights: transformers' AutoTokenizer loads the directory
    offline and encodes as the `tokenizers` object does; a tokenizer that is not the run's is refused first."""
    tok = small_bpe()
    assert tok.encode("quick").tokens == ["quick"]  # merges learned, not characters alone
    tok.save(str(run / "tokenizer.json"))  # what the trainer writes (the BPE of a prepared dataset)
    assert main(["to-hf", str(run), str(tmp_path / "hf_tok")]) == 0
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf_tok")
    text = "the lazy fox jumps over five brown jugs"
    assert loaded(text)["input_ids"] == tok.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == tok.token_to_id("<|endoftext|>")
    hf_config = LlamaForCausalLM.from_pretrained(tmp_path / "hf_tok").config
    assert hf_config.vocab_size >= tok.get_vocab_size() and hf_config.bos_token_id is None
    assert hf_config.eos_token_id == tok.token_to_id("<|endoftext|>")  # not Llama 2's default 2

    capsys.readouterr()
    for text, words in (("{not json", "is not a tokenizers JSON"), (json.dumps({"model": 3}), "not a tokenizers")):
        (run / "tokenizer.json").write_text(text)
        assert main(["to-hf", str(run), str(tmp_path / "hf_bad")]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not (tmp_path / "hf_bad").exists()  # refused before anything is written
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))  # 300 ids > 256 rows
    with pytest.raises(ConvertError, match="token ids up to 299 but the model's embedding has 256 rows"):
        hf_tokenizer.read_run_tokenizer(_saved(big, tmp_path / "big"), 256)
    (tmp_path / "fifo_run").mkdir()
    os.mkfifo(tmp_path / "fifo_run" / "tokenizer.json")
    with pytest.raises(ConvertError, match="not a regular file"):  # never read (a FIFO would block forever)
        hf_tokenizer.read_run_tokenizer(tmp_path / "fifo_run", 256)


def test_end_of_text_is_the_datas_end_of_document():
    """to-hf names as the end of text the token the trainer's data ends documents with (`find_eod`), a plain
    vocabulary entry too, not only a special added token; a tokenizer with none gets none."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2, "b": 3}, unk_token="[UNK]"))
    text = tok.to_str()
    assert hf_tokenizer.end_of_text(text) == ("</s>", 2)
    assert from_tokenizer(tok, text, "test").eod_id == 2
    assert hf_tokenizer.special_ids(text)["eos_token_id"] == 2
    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str()
    assert hf_tokenizer.end_of_text(plain) is None and hf_tokenizer.special_ids(plain)["eos_token_id"] is None


def _saved(tok: Tokenizer, run):
    run.mkdir()
    tok.save(str(run / "tokenizer.json"))
    return run


def test_from_hf_run_fine_tunes_with_resume(tmp_path, one_thread, capsys):
    """from-hf makes a run at step 0; `train --config RUN_OUT/finetune.toml --resume` trains it, and its first
    logged loss is the HF model's loss on the same global batch."""
    cfg = get_preset("tiny", **MODEL, tie_embeddings=True)
    state = build_model(cfg, seed=7).state_dict()
    state["tok_emb.weight"] *= 30  # far from a fresh init's loss of ~ln(256): the weights must be the ones used
    hf_config, hf_state = to_hf_state(cfg, state)
    hf_files.write_hf_dir(tmp_path / "hf", hf_config, hf_state)
    flags = ["--max-bytes", "50000", "--batch-size", "4", "--seq-len", "32", "--steps", "2", "--warmup-steps", "0",
             "--eval-every", "0", "--ckpt-every", "0", "--peak-flops", "1e12", "--no-plot"]
    out = tmp_path / "ft"
    assert main(["from-hf", str(tmp_path / "hf"), str(out), *flags]) == 0
    summary = train.train(parse_config(["--config", str(out / "finetune.toml"), "--resume"]))
    assert summary["resumed_from"] == 0 and summary["steps"] == [0, 1]

    corpus = load_corpus(None, 0.05, 50_000)
    inputs, targets = BatchSampler(corpus.train, 32, 4, seed=0).batch(0)
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = lm_loss(ref(input_ids=inputs).logits, targets).item()
    assert abs(summary["losses"][0] - want) < 1e-5, (summary["losses"][0], want)
    # --ckpt-every 0 left only step 0: resuming from it again redoes the same steps and logs each once
    again = train.train(parse_config(["--config", str(out / "finetune.toml"), "--resume"]))
    assert again["losses"] == summary["losses"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]

    # the same OUT again: refused in one line, nothing replaced
    capsys.readouterr()
    assert main(["from-hf", str(tmp_path / "hf"), str(out), *flags]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--tp", "2"]) == 2
    assert "--tp" in capsys.readouterr().err


def test_command_line_help_and_errors(tmp_path, capsys):
    for argv in (["--help"], ["to-hf", "--help"], ["from-hf", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "Llama" in capsys.readouterr().out
    assert main(["to-hf", str(tmp_path / "none"), str(tmp_path / "hf")]) == 2
    assert main(["from-hf", str(tmp_path / "none"), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "is not a directory" in err[0] and "is not a directory" in err[1]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "run").exists()
