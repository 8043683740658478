"""Reads of tensor values on the host per training step (the issue's "host syncs"): a GPU's host waits at each for
every queued kernel. Counted on the CPU by `minidist.debug.host_reads` (bench/syncs.py prints them by layout): a
step that does not log reads at most one value (dense any dp/ZeRO layout, MoE without expert parallelism)."""

import torch

from minidist.comm.launch import run_ranks
from minidist.debug.host_reads import HostReads, count_run, logging_steps
from minidist.train.config import TrainConfig

DENSE = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}
MOE = {**DENSE, "moe": {"n_experts": 4, "top_k": 2, "bias_update_speed": 0.05, "capacity_factor": 1.0}}


def config(out: str, model: dict, **layout) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=dict(model), max_bytes=100_000, batch_size=8, seq_len=32,
                       microbatches=2, steps=4, warmup_steps=1, grad_clip=1.0, eval_every=0, check_every=0,
                       ckpt_every=0, log_every=100, out=out, seed=0, peak_flops=1e12, plot=False, **layout)


def quiet_reads(counts: dict) -> dict[int, dict]:
    """The sites read on each step that does not log."""
    return {s: counts["sites"][s] for s in counts["reads"] if s not in counts["logging"]}


def _rank_reads(out: str) -> dict:
    torch.set_num_threads(1)
    return count_run(config(out, DENSE, dp=2, zero=1), ops=False)


def test_the_counter_sees_the_package_and_only_it():
    from minidist.train import metrics

    t = torch.ones(())
    with HostReads() as reads:
        float(t), t.item(), bool(t)  # this file's reads: not the package's
        reads.next_step()
        metrics.jsonable({"loss": t})  # the package's: one .tolist()
    assert reads.total(-1) == 0 and reads.total(0) == 1
    assert all(site.startswith("train/metrics.py:") and site.endswith(" tolist") for site in reads.per_step[0])
    assert logging_steps(4, 100) == [0, 3] and logging_steps(8, 4) == [0, 3, 7]


def test_dense_step_reads_at_most_one_value(tmp_path):
    counts = count_run(config(str(tmp_path / "one"), DENSE), ops=False)
    assert all(sum(sites.values()) <= 1 for sites in quiet_reads(counts).values()), quiet_reads(counts)
    zero1 = run_ranks(_rank_reads, 2, str(tmp_path / "zero1"), timeout=120)
    for rank in zero1:
        assert all(sum(sites.values()) <= 1 for sites in quiet_reads(rank).values()), quiet_reads(rank)


def test_moe_step_reads_at_most_one_value(tmp_path):
    # the grouped experts (what "auto" runs under CUDA's bf16): the per-expert loop reads its slices' sizes
    counts = count_run(config(str(tmp_path / "moe"), MOE, expert_backend="grouped_mm"), ops=False)
    assert all(sum(sites.values()) <= 1 for sites in quiet_reads(counts).values()), quiet_reads(counts)


def test_doc_mask_step_reads_at_most_one_value(tmp_path):
    """--doc-mask: the document ids and the attention pairs (MFU) of each step come without a read of a value; the
    window's pair counts are read with its other figures, on the logging step."""
    counts = count_run(config(str(tmp_path / "docs"), DENSE, doc_mask=True), ops=False)
    assert all(sum(sites.values()) <= 1 for sites in quiet_reads(counts).values()), quiet_reads(counts)
