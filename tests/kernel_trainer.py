"""The trainer with --attention-kernel triton against --attention-kernel sdpa, in a process started under Triton's
interpreter (tests/test_kernels.py starts `python tests/kernel_trainer.py ROOT` with TRITON_INTERPRET=1): 2 steps
of a 2-layer GQA model on short documents, with and without --doc-mask; the losses, validation losses and
gradient norms of each run, and how many times the Triton kernel ran, to ROOT/found.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_train_documents import write_documents  # noqa: E402

from minidist.kernels import flash  # noqa: E402
from minidist.train import loop as train  # noqa: E402
from minidist.train.config import TrainConfig  # noqa: E402

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 128}
CALLS = {"forward": 0, "backward": 0}


def counted(name, function):
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return function(*args, **kwargs)
    return wrapper


def run(root: Path, kernel: str, doc_mask: bool) -> dict:
    """Rows of 96 tokens: one 64-token tile of queries and a partial one, documents crossing both."""
    out = root / f"{kernel}_{'docs' if doc_mask else 'plain'}"
    cfg = TrainConfig(model="tiny", model_overrides=dict(MODEL), data=str(root / "docs"), batch_size=4, seq_len=96,
                      microbatches=2, steps=2, warmup_steps=1, grad_clip=1.0, eval_every=0, eval_batches=1,
                      log_every=100, ckpt_every=0, out=str(out), seed=0, peak_flops=1e12, plot=False,
                      doc_mask=doc_mask, attention_kernel=kernel)
    summary = train.train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": summary["losses"], "val": [r["val_loss"] for r in rows if "val_loss" in r],
            "grad_norms": [r["grad_norm"] for r in rows]}


def main(root: Path) -> None:
    torch.set_num_threads(1)
    flash.flash_forward = counted("forward", flash.flash_forward)
    flash.flash_backward = counted("backward", flash.flash_backward)
    write_documents(root)
    found = {f"{kernel} {doc}": run(root, kernel, doc == "docs") for doc in ("plain", "docs")
             for kernel in ("sdpa", "triton")}
    (root / "found.json").write_text(json.dumps({"runs": found, "calls": CALLS}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
