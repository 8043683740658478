"""minidist.hardware: one record per chip (its peak, memory, links and CUDA name), the link table's units, its use
of the α-β model, and the one rule for which link a group crosses."""

import pytest

from minidist import hardware
from minidist.comm.cost_model import cost_terms
from minidist.plan.cluster import cluster_for_chip


def test_one_record_per_chip() -> None:
    names = [chip.name for chip in hardware.CHIPS]
    assert len(names) == len(set(names))
    for machine in hardware.MACHINES.values():
        chip = hardware.chip(machine.chip)
        assert machine.peak_flops == chip.dense_peak["bf16"] == hardware.peak_flops(machine.chip)
        assert (machine.intra, machine.inter) == (chip.intra, chip.inter)
    assert hardware.MACHINES["dgx-h100"].intra is hardware.LINKS["nvlink4"]
    assert hardware.chip("H200-SXM").memory_bytes == 141e9 and hardware.chip("A100").memory_bytes == 80 * 2**30
    assert "TPUv4" not in hardware.node_chips() and "H800" in hardware.node_chips()  # TPU v4: a peak, no node
    with pytest.raises(ValueError, match="known chips"):
        hardware.chip("cpu")


def test_link_units() -> None:
    # Quoted figures: NVLink 4 = 900 GB/s both directions; NDR = 400 Gb/s one direction; one direction is stored.
    assert hardware.LINKS["nvlink4"].bandwidth == 450e9
    assert hardware.LINKS["ib-ndr400"].bandwidth == 50e9
    assert hardware.LINKS["nvlink4"].bandwidth / hardware.LINKS["ib-ndr400"].bandwidth == 9
    for link in hardware.LINKS.values():
        assert link.bandwidth > 0 and 0 < link.latency < 1e-4 and link.beta == 1 / link.bandwidth


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "send"])
@pytest.mark.parametrize("p", [2, 8, 64])
def test_collective_time_is_the_alpha_beta_model(op: str, p: int) -> None:
    link, nbytes = hardware.LINKS["nvlink4"], 3e8
    steps, sent = cost_terms(op, nbytes, p)
    assert hardware.collective_time(op, nbytes, p, link) == pytest.approx(steps * link.latency + sent / link.bandwidth)
    if op == "all_reduce":  # the ring: 2(p-1) steps and 2(p-1)/p of the tensor
        want = 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency
        assert hardware.collective_time(op, nbytes, p, link) == pytest.approx(want)


def test_link_of_a_group() -> None:
    dgx = hardware.MACHINES["dgx-h100"]
    assert hardware.link_of(dgx, 8) is hardware.LINKS["nvlink4"]
    assert hardware.link_of(dgx, 9) is hardware.LINKS["ib-ndr400"]
    with pytest.raises(ValueError):
        hardware.link_of(dgx, 0)
    cluster = cluster_for_chip("H100-SXM")  # the planner's cluster crosses the same links by the same rule
    assert [hardware.link_of(cluster, n) for n in (8, 9)] == [hardware.link_of(dgx, n) for n in (8, 9)]


def test_compute_time() -> None:
    assert hardware.compute_time(989e12, "H100-SXM") == pytest.approx(1.0)
    assert hardware.compute_time(989e12, "H100-SXM", mfu=0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        hardware.compute_time(1.0, "H100-SXM", mfu=0)
