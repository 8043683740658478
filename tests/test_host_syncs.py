"""No hidden syncs on CUDA, rehearsed on the CPU: what a step does that would make a GPU's host wait, found by the
aten operators it dispatches (`minidist.debug.host_reads.OpCount`) and the calls it makes, not by timing."""

import torch

from minidist.comm.communicator import Comm
from minidist.debug.host_reads import HostReads, OpCount
from minidist.model import get_preset
from minidist.model.moe.dispatch import plan_dispatch
from minidist.model.moe.layer import MoELayer
from minidist.parallel.ep.expert import arrival_order
from minidist.train import loop
from minidist.trust import replicas

MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 16}


def _moe_layer(backend: str) -> MoELayer:
    cfg = get_preset("tiny", **MODEL, moe={"n_experts": 4, "top_k": 2, "capacity_factor": 1.0})
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    layer.experts.backend = backend
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_the_detector_sees_data_sized_operators():
    """The check below can fail: boolean indexing, nonzero and repeat_interleave of tensor repeats are seen;
    repeat_interleave with output_size and index with integer indices are not."""
    x, mask, repeats = torch.arange(6.0), torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.bool), torch.tensor([1, 2])
    with OpCount() as ops:
        x[mask], mask.nonzero(), repeats.repeat_interleave(repeats), x.masked_select(mask)
    assert ops.shape[-1] == 4, dict(ops.shape_ops)
    with OpCount() as ops:
        repeats.repeat_interleave(repeats, output_size=3), x[torch.tensor([0, 2])], torch.where(mask, x, 0)
    assert ops.shape[-1] == 0, dict(ops.shape_ops)


def test_moe_with_a_capacity_sizes_nothing_from_values():
    """A capacity factor drops slots; keeping the kept ones by a boolean mask (the unpadded plan) sizes a tensor
    from a count. The layer's padded plan, forward and backward on the grouped_mm path (CUDA's), sizes none, and
    gives the layer's output and gradients of the kept-only plan."""
    torch.manual_seed(1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    layer = _moe_layer("grouped_mm")
    routing = layer.route(x.detach().reshape(-1, 32))
    with OpCount() as ops:
        plan_dispatch(routing.indices, routing.weights, 4, capacity=4, seq_len=16)
    assert ops.shape[-1] > 0  # the unpadded plan: order[kept]
    with OpCount() as ops:
        y = layer(x)
        y.square().sum().backward()
    assert ops.shape[-1] == 0, dict(ops.shape_ops)
    assert layer.last_stats["drop_rate"] > 0  # the capacity dropped slots: the case this is about
    got, grad = y.detach(), x.grad.clone()
    x.grad = None
    loop_layer = _moe_layer("loop")  # the same weights, one matmul per expert on the kept rows only
    loop_layer.load_state_dict(layer.state_dict())
    want = loop_layer(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)


def test_arrival_order_with_its_size_reads_nothing():
    received = torch.tensor([[2, 0, 1], [1, 3, 0]])
    with OpCount() as ops:
        order = arrival_order(received, 7)
    assert ops.shape[-1] == 0 and torch.equal(order, arrival_order(received))


class _HostRows:
    """A host tensor's calls on its way to a device, recorded (CUDA is not needed to see which calls are made)."""

    def __init__(self) -> None:
        self.calls: list = []

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking))
        return self


def test_batches_go_to_cuda_from_pinned_memory_without_waiting():
    rows = _HostRows()
    loop.to_device(rows, torch.device("cuda", 1))
    assert rows.calls == ["pin_memory", ("to", "cuda:1", True)]
    rows = _HostRows()
    loop.to_device(rows, torch.device("cpu"))  # a CPU pins nothing (a CUDA build's allocator) and copies nothing
    assert rows.calls == [("to", "cpu", True)]
    t = torch.arange(4)
    assert loop.to_device(t, torch.device("cpu")) is t


def test_replica_digest_is_computed_where_the_tensor_is():
    """One flipped bit in any position changes the digest; equal bytes give equal digests (a copy, a slice's
    clone); a check's host reads do not grow with the number of tensors (no host copy of the parameters)."""
    t = torch.randn(7, 3)
    digest = replicas.device_digest(t)
    assert digest.dtype == torch.int64 and digest.device == t.device and digest.dim() == 0
    words = t.clone().reshape(-1).view(torch.int32)
    for i in range(words.numel()):
        for bit in range(32):
            flipped = words.clone()
            flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            assert int(replicas.device_digest(flipped.view(torch.float32).reshape(7, 3))) != int(digest), (i, bit)
    assert int(replicas.device_digest(t.clone())) == int(digest)
    assert int(replicas.device_digest(t.reshape(3, 7))) != int(digest)  # shape counts
    assert int(replicas.device_digest(t[1:].clone())) == int(replicas.device_digest(t[1:]))  # an offset view

    def reads_of_a_check(n: int) -> int:
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(n)))
        listed = [replicas.Entry(name, p) for name, p in model.named_parameters()]
        with HostReads() as counted:
            replicas.compare("dp_cp", listed, Comm())
        return counted.total(-1)

    assert reads_of_a_check(2) == reads_of_a_check(6) <= 3
