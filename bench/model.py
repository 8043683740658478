"""Training-step speed of the minidist model against Hugging Face's LlamaForCausalLM of the same architecture.

    .venv/bin/python bench/model.py [--preset small] [--batch 8] [--seq 256] [--steps 10] [--warmup 3] [--threads N]

Both models compute the same function: the reference is built from a LlamaConfig with our shapes (no download),
our weights are copied into it, and the logits must agree before anything is timed. Each step is forward +
cross-entropy + backward. The two models alternate step by step, so a change in machine load hits both alike; the
median step time of each is reported. Last line: a JSON object with `ratio` = minidist time / reference time (the
median over steps of the ratio of the two back-to-back step times).

Needs `transformers` (the `bench` extra), which minidist itself does not depend on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from minidist.convert.hf_model import ConvertError, to_hf_state
from minidist.flops import flops_per_token, measure_matmul_peak
from minidist.model import build_model, get_preset, lm_loss
from minidist.model.config import ModelConfig


def reference_model(cfg: ModelConfig, ours: torch.nn.Module):
    """A transformers LlamaForCausalLM with the shapes of cfg and our model's weights, through the package's own
    converter (minidist.convert.hf_model: the config, the names and, for an interleaved RoPE layout, the q/k rows)."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        sys.exit("bench/model.py needs Hugging Face transformers for its reference model: "
                 ".venv/bin/pip install transformers  (or: pip install -e '.[bench]')")
    try:
        hf_values, hf_state = to_hf_state(cfg, ours.state_dict())
    except ConvertError as e:
        sys.exit(f"the reference is HF Llama: {e} (use e.g. the tiny or small preset)")
    hf_cfg = LlamaConfig.from_dict({**hf_values, "use_cache": False})
    hf_cfg._attn_implementation = "sdpa"
    ref = LlamaForCausalLM(hf_cfg)
    ref.load_state_dict(hf_state, strict=not cfg.tie_embeddings)  # tied: lm_head is the embedding, as HF saves it
    return ref, transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = get_preset(args.preset)
    ours = build_model(cfg, seed=args.seed)
    ref, hf_version = reference_model(cfg, ours)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        a, b = ours(tokens), ref(input_ids=tokens).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"minidist and HF logits differ: {m}")
    max_diff = (a - b).abs().max().item()

    def step(model, forward):
        model.zero_grad(set_to_none=True)
        logits = forward(tokens)
        loss = lm_loss(logits[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.item()

    runs = {"minidist": (ours, lambda t: ours(t)), "reference": (ref, lambda t: ref(input_ids=t).logits)}
    losses = {name: step(model, fwd) for name, (model, fwd) in runs.items()}
    assert abs(losses["minidist"] - losses["reference"]) < 1e-4, losses
    grads = {name: dict(model.named_parameters()) for name, (model, _) in runs.items()}
    g_ours = grads["minidist"]["blocks.0.attn.wq.weight"].grad
    g_ref = grads["reference"]["model.layers.0.self_attn.q_proj.weight"].grad
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-3, atol=1e-6, msg=lambda m: f"gradients differ: {m}")

    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            model, fwd = runs[name]
            start = time.perf_counter()
            step(model, fwd)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    # Steps i of the two models ran back to back, under the same machine load: the median of their ratios is the
    # comparison least disturbed by other processes (the ratio of the medians is printed too).
    paired = statistics.median(a / b for a, b in zip(times["minidist"], times["reference"]))

    n_tokens = args.batch * args.seq
    fpt = flops_per_token(cfg, args.seq)
    peak, _ = measure_matmul_peak([(1024, 1024, 1024)], torch.float32)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"preset {args.preset}: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads "
          f"({cfg.n_kv_heads} kv), batch {args.batch} x seq {args.seq}, torch {torch.__version__}, "
          f"transformers {hf_version}, {torch.get_num_threads()} threads; logits max |diff| {max_diff:.1e}")
    print(f"{'model':<10} {'median s/step':>14} {'min':>8} {'max':>8} {'tokens/s':>10} {'GFLOP/s':>9} "
          f"{'MFU vs matmul':>14}")
    for name, t in times.items():
        tps = n_tokens / median[name]
        print(f"{name:<10} {median[name]:>14.4f} {min(t):>8.4f} {max(t):>8.4f} {tps:>10.0f} "
              f"{tps * fpt / 1e9:>9.1f} {tps * fpt / peak:>14.1%}")
    print(f"(measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s, 1024^3)")
    print(f"ratio minidist/reference: median of paired step ratios {paired:.3f}, "
          f"ratio of medians {median['minidist'] / median['reference']:.3f}")
    print(json.dumps({"ratio": round(paired, 4), "ratio_of_medians": round(median["minidist"] / median["reference"], 4),
                      "minidist_s": round(median["minidist"], 5),
                      "reference_s": round(median["reference"], 5), "preset": args.preset, "batch": args.batch,
                      "seq": args.seq, "steps": args.steps, "transformers": hf_version}))


if __name__ == "__main__":
    main()
