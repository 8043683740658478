"""Chapter 18's DCP resharding case, run on the ranks of tests/native_cases.py's launch: a minidist run's checkpoint
exported by `to-dcp`, loaded by an FSDP2 model on another number of ranks through DCP's own resharding, trained on,
and saved again for `from-dcp`. Rank processes import this module, so it stays free of pytest."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.topology import Topology
from minidist.convert import dcp as dcp_convert
from minidist.convert import dcp_files, titan_model
from minidist.model import build_model, lm_loss
from minidist.native import fsdp, mesh

STEPS_ON_FSDP = 2


def _states(model, optimizer):
    """({DCP key: tensor} of the model and Adam's state under torchtitan's names, the optimizer state dict)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    weights = {titan_model.titan_name(n): t for n, t in get_model_state_dict(model).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    adam = {}
    for key, value in optim.items():
        if key.startswith("state."):
            name, kind = key[len("state."):].rsplit(".", 1)
            adam[dcp_convert.optimizer_key(titan_model.titan_name(name), kind)] = value
    return weights, adam, optim, options


def fsdp_continues(topo: Topology, dcp_dir: str, dcp_out: str) -> dict:
    """Load DCP_DIR into a minidist model under FSDP2 on this launch's ranks (in torchtitan's RoPE layout, so the
    checkpoint loads as it is), train STEPS_ON_FSDP steps the way the trainer does, save them to DCP_OUT."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from minidist.data.sampler import BatchSampler
    from minidist.train.config import config_from_values, model_config
    from minidist.train.config_checks import lr_schedule
    from minidist.train.loop import load_data
    from minidist.train.optim import build_optimizer

    rank, world = topo.coord("dp_cp"), topo.size("dp_cp")
    cfg = config_from_values(dcp_convert.read_run_file(Path(dcp_dir)))
    mcfg = dataclasses.replace(model_config(cfg), rope_layout="interleaved")
    model = build_model(mcfg, seed=cfg.seed + 1)  # every value is overwritten by the load
    fsdp.fully_shard_model(model, mesh.device_mesh(topo.dims, "replicas")["dp_cp"])
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
    weights, adam, optim, options = _states(model, optimizer)
    step = torch.zeros((), dtype=torch.int64)
    dcp.load({**weights, **adam, dcp_convert.STEP_KEY: step}, storage_reader=dcp_files.safe_reader(Path(dcp_dir)))
    set_model_state_dict(model, {titan_model.minidist_name(k): v for k, v in weights.items()})
    set_optimizer_state_dict(model, optimizer, optim, options=options)  # the loaded tensors are optim's own
    sampler = BatchSampler(load_data(cfg).train, cfg.seq_len, cfg.batch_size, cfg.seed)
    schedule, comm, losses, start = lr_schedule(cfg), topo.comm("dp_cp"), [], int(step)
    for s in range(start, start + STEPS_ON_FSDP):
        schedule.apply(optimizer, s)
        x, y = sampler.shard(s, rank, world)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(comm.all_reduce(loss.detach().clone()).item() / world)
    weights, adam, _, _ = _states(model, optimizer)
    done = torch.tensor(start + STEPS_ON_FSDP, dtype=torch.int64)
    dcp.save({**weights, **adam, dcp_convert.STEP_KEY: done}, storage_writer=dcp.FileSystemWriter(dcp_out))
    if rank == 0:
        shutil.copy(Path(dcp_dir) / dcp_convert.RUN_FILE, Path(dcp_out) / dcp_convert.RUN_FILE)
    dist.barrier()
    return {"start": start, "losses": losses}
