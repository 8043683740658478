"""The device sentinel: a CPU run in which a tensor made without `device=` is not on the device the rank computes on.

On a GPU, `torch.zeros(3)` lands on the CPU while the rank computes on cuda:N, and fails at its first use: NCCL
refuses it ("No backend type associated with device type cpu"), an op that meets the rank's tensors raises
("Expected all tensors to be on the same device"). On a CPU run both devices are the CPU and nothing can see the
mistake. Inside `device_sentinel()` the rank still computes on "cpu", but:

- the default device is "meta" (`torch.device("meta")` entered as a context: `torch.set_default_device`, for the
  block only), so a factory call without `device=` (`torch.tensor`, `torch.zeros`, `torch.arange`, ...) makes a
  tensor without data, and reading it (`.item()`, `.tolist()`, `.to("cpu")`) raises;
- the trainer's Comms check every tensor against its compute device (`Topology(device=)`, `Comm.expect_device`):
  a meta tensor handed to a collective or a point-to-point call is refused before it communicates, in one line
  naming the op, the group, the device found and the one expected;
- `MixedDevices` refuses a torch call that meets a meta tensor and a tensor elsewhere. Torch itself lets `meta + cpu`
  through (the result is meta) and indexes a CPU tensor with meta indices without a word (the rows are garbage):
  on a GPU both would be "Expected all tensors to be on the same device".

Scope: around the trainer's calls inside each rank (after `run_ranks` has joined the process group), not the whole
process, so that the launcher's own bookkeeping (results pickled with torch.save, the rendezvous) stays outside.
Torch's own code on the trainer's path (AdamW's state, which makes its step counters with device="cpu"; autograd;
torch.save / torch.load of checkpoints; gloo) runs unchanged under it (torch 2.13). It is stricter than a GPU in
one case: a 0-d tensor made without `device=` and combined with the rank's tensors (a CPU scalar, which CUDA
kernels accept) is refused here too; the package makes every tensor where it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

SENTINEL_DEVICE = torch.device("meta")


def _tensors(items: Iterable) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, and inside its list and tuple arguments (foreach ops, indices)."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, list | tuple):
            yield from (x for x in item if isinstance(x, torch.Tensor))


class MixedDevices(TorchFunctionMode):
    """Refuse any torch call whose tensors lie on the sentinel device and elsewhere, as a GPU refuses cpu + cuda."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in _tensors((*args, *kwargs.values()))}
        if SENTINEL_DEVICE in devices and len(devices) > 1:
            others = ", ".join(sorted(str(d) for d in devices - {SENTINEL_DEVICE}))
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise RuntimeError(f"device sentinel: {name} meets a tensor made without device= (on meta) and "
                               f"tensors on {others}; on a GPU: 'Expected all tensors to be on the same device'")
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_sentinel() -> Iterator[None]:
    """Within the block, tensors made without `device=` land on the meta device and fail at their first use."""
    with torch.device(SENTINEL_DEVICE), MixedDevices():
        yield
