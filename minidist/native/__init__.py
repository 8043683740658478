"""minidist beside PyTorch's own distributed stack (chapter 18): each piece the course built held against the one
PyTorch ships, by the same numbers.

- `mesh.py`: the rank grid of a `Layout` as a `DeviceMesh` with named dims (the same coordinates and groups), and back;
- `placements.py`: a parameter's `Placement` as DTensor placements (`Shard` / `Replicate` / `Partial`), and back; a
  `redistribute` named as the collective it runs, with its bytes by `Comm`'s ledger formula;
- `fsdp.py`: a model under FSDP2's `fully_shard` the way ZeRO-3 shards it, what each gathers ahead;
- `tensor_parallel.py`: minidist's column/row/sequence-parallel plan as a `parallelize_module` plan;
- `pipelining.py`: the same stages under `torch.distributed.pipelining`'s schedules, and their action lists beside
  minidist's.

A tool on top of the package, like plan/, debug/ and convert/: it imports the layers below and no other tool.
Checkpoints in torch.distributed.checkpoint's format are convert/'s (`to-dcp`, `from-dcp`).
"""
