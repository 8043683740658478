"""What the launcher and the backend say, and what the trainer decides from it (minidist.comm.backend): each
process's place under torchrun, srun, both, or neither; one-line errors for variables that do not fit; the NCCL and
CUDA settings the trainer sets, never over a user's own."""

from pathlib import Path

import pytest
import torch.distributed as dist

from minidist.comm import backend
from minidist.comm.bootstrap import DistEnv
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.preflight import preflight

RENDEZVOUS = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
# What srun sets in its 2nd task of a one-node, 2-task step (without torchrun).
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **RENDEZVOUS}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *SRUN)


def test_no_launcher_is_one_process():
    assert backend.place({}) == backend.Place(0, 1, 0, 1, "single")


def test_torchrun_variables():
    assert backend.place(TORCHRUN) == backend.Place(3, 8, 1, 2, "torchrun")


def test_srun_without_torchrun():
    assert backend.place({**SRUN, **RENDEZVOUS}) == backend.Place(1, 2, 1, 2, "slurm")


def test_torchrun_inside_slurm_wins():
    """torchrun started by srun (one per node) sees SLURM's step (1 task per node) and its own workers' places."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
    assert backend.place({**slurm, **TORCHRUN}) == backend.Place(3, 8, 1, 2, "torchrun")


def test_an_sbatch_script_is_one_process():
    """sbatch runs the script once whatever --ntasks says (SLURM_NTASKS=4, SLURM_PROCID=0, no job step): a trainer
    started there directly must not wait for 3 peers that never come. A 1-task srun step is one process too."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "42"}
    assert backend.place(batch) == backend.Place()
    one = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
    assert backend.place(one) == backend.Place(0, 1, 0, 1, "slurm")


def test_srun_needs_a_rendezvous_address():
    with pytest.raises(ValueError) as info:
        backend.place(SRUN)
    message = str(info.value)
    assert "MASTER_ADDR and MASTER_PORT not set" in message and "scontrol show hostnames" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match="MASTER_PORT not set"):
        backend.place({**SRUN, "MASTER_ADDR": "node0"})
    with pytest.raises(ValueError, match="not a port number"):
        backend.place({**SRUN, **RENDEZVOUS, "MASTER_PORT": "70000"})


@pytest.mark.parametrize("changes, words", [
    ({"RANK": "8"}, "RANK=8 is outside 0..7"),
    ({"RANK": "-1"}, "RANK=-1 is outside 0..7"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside 0..1"),
    ({"RANK": None}, "RANK not set but WORLD_SIZE is"),
])
def test_torchrun_variables_that_do_not_fit(changes, words):
    environ = {k: v for k, v in {**TORCHRUN, **changes}.items() if v is not None}
    with pytest.raises(ValueError) as info:
        backend.place(environ)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("changes, words", [
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is outside 0..1"),
    ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is outside 0..1"),
])
def test_slurm_variables_that_do_not_fit(changes, words):
    with pytest.raises(ValueError, match=words):
        backend.place({**SRUN, **RENDEZVOUS, **changes})


def test_tasks_per_node_list():
    assert backend.tasks_on_node("4(x2),3", 0) == 4
    assert backend.tasks_on_node("4(x2),3", 2) == 3
    assert backend.tasks_on_node("4(x2),3", 3) is None
    assert backend.tasks_on_node("", 0) is None and backend.tasks_on_node("a", 0) is None


def test_cuda_device_of_a_rank():
    torchrun = backend.place(TORCHRUN)
    assert backend.cuda_index(torchrun, 2) == 1
    with pytest.raises(ValueError, match="local rank 1 needs 2 CUDA devices, this node shows 1"):
        backend.cuda_index(torchrun, 1)
    # srun --gpus-per-task=1: each task sees only its own GPU, as device 0
    assert backend.cuda_index(backend.place({**SRUN, **RENDEZVOUS}), 1) == 0


def test_dist_env_reads_srun_variables():
    """srun without torchrun: today's main read only RANK/WORLD_SIZE and said rank 0 of 1 in every task, so N
    tasks trained N copies on cuda:0 into one OUT."""
    assert not dist.is_initialized()
    env = DistEnv.detect({**SRUN, **RENDEZVOUS})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 2, 1, "slurm")


def _clear_launcher(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_preflight_places_an_srun_task(tmp_path, monkeypatch):
    _clear_launcher(monkeypatch)
    for name, value in {**SRUN, **RENDEZVOUS}.items():
        monkeypatch.setenv(name, value)
    checked = preflight(TrainConfig(device="cpu", out=str(tmp_path / "run")))
    assert (checked.env.rank, checked.env.world_size) == (1, 2)
    assert checked.layout.dims.dp == 2


def test_preflight_words_a_missing_rendezvous_as_one_config_error(tmp_path, monkeypatch):
    _clear_launcher(monkeypatch)
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT not set") as info:
        preflight(TrainConfig(device="cpu", out=str(tmp_path / "run")))
    assert "\n" not in str(info.value) and not dist.is_initialized()


def test_nccl_settings_end_a_timeout_and_keep_its_record_in_out():
    settings = backend.nccl_settings(Path("/runs/x/flight"), {})
    assert settings == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": "/runs/x/flight/nccl_rank_"}


def test_a_users_nccl_values_are_kept_under_either_name():
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/mine_"}
    assert backend.nccl_settings(Path("/o/flight"), user) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    environ = dict(user)
    applied = backend.apply_settings(backend.nccl_settings(Path("/o/flight"), environ), environ)
    assert applied == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert environ == {**user, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def test_cuda_allocator_setting_unless_the_user_has_one():
    assert backend.cuda_settings({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert backend.cuda_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert backend.cuda_settings({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert backend.apply_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, environ) == {}
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


def test_gloo_sets_nothing():
    """The backend is a function of the device: a CPU (gloo) job, or one process, gets no NCCL setting."""
    assert backend.backend_name("cpu") == "gloo" and backend.backend_name("cuda") == "nccl"
    assert backend.process_group_settings("cpu", 8, Path("/o/flight"), {}) == {}
    assert backend.process_group_settings("cuda", 1, Path("/o/flight"), {}) == {}
    assert backend.process_group_settings("cuda", 2, Path("/o/flight"), {}) == backend.nccl_settings(
        Path("/o/flight"), {})
