"""Trust nothing, round three (issue #45): every rank's error reaches the user (srun-style, torchrun's summary, a rank
alone), and the small cases of the command line (timeouts' floor, SLURM's variable named, --resume on an OUT without
a run, near-miss flags, how many processes to launch, --help's defaults).

Data checked against the model, memory bombs and late links: tests/test_trust_data.py.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_trust import cli  # noqa: F401 - a fixture

from minidist.comm import backend
from minidist.train import loop as train
from minidist.train.config import build_parser

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--set", "model.n_layers=1", "--set",
        "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.d_ff=64",
        "--no-plot", "--peak-flops", "1e9", "--eval-every", "0", "--comm-timeout", "3", "--ckpt-timeout", "3"]
LAUNCH_TIMEOUT_S = 180  # a bound on a hang, far above what a loaded machine takes (the runs last seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}


def srun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What srun sets for one task of a step (and the MASTER_* an sbatch script exports)."""
    return {**base_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
            "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "minidist.train", *argv], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, who: str) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{who} still running after {LAUNCH_TIMEOUT_S} s")
    return proc.returncode, err


def corpus(directory: Path) -> None:
    directory.mkdir()
    (directory / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)


# ------------------------------------------------------------------------------------------------------------------
# an error one rank alone meets reaches the user


def test_srun_style_only_rank_1_misses_its_data(tmp_path):
    """Two tasks as srun starts them; rank 1 runs where the relative --data path does not exist (another node)."""
    corpus(tmp_path / "node0")
    (tmp_path / "node1").mkdir()
    port, argv = free_port(), [*TINY, "--data", "corpus.txt", "--out", str(tmp_path / "run")]
    procs = [start(argv, srun_env(r, 2, port), tmp_path / f"node{r}") for r in (0, 1)]
    (code0, err0), (code1, err1) = (finish(p, f"rank {r}") for r, p in enumerate(procs))
    assert code1 == 2 and err1.splitlines() == [
        "error: rank 1: data path 'corpus.txt' does not exist; give a text file, a directory, a glob, a .bin/.npy "
        "file, 'stdlib', or a dataset directory (python -m minidist.data prepare)"], err1
    # rank 0 waited for it at the rendezvous, bounded by --comm-timeout, and says so in one line
    assert code0 == 1 and err0.splitlines()[-1].startswith("error: rank 0: could not join the job's processes at "
                                                           f"127.0.0.1:{port} within --comm-timeout 3 s"), err0
    assert "Traceback" not in err0 + err1


def test_torchrun_summary_shows_the_failed_ranks_line(tmp_path):
    """Under torchrun the agent's summary names the first failure's error file: it holds rank 1's line."""
    corpus(tmp_path / "node0")
    argv = [*TINY, "--data", "corpus.txt", "--out", str(tmp_path / "run"), "--inject-fault",
            "bitflip:1:1:no.such.weight"]  # a parameter only rank 1 looks for, after the process group exists
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), "-m", "minidist.train", *argv], env=base_env(),
                            cwd=tmp_path / "node0", text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, err = finish(proc, "torchrun")
    line = "rank 1: --inject-fault 'bitflip:1:1:no.such.weight': rank 1 has no parameter 'no.such.weight'"
    assert code != 0 and any(x.startswith(f"error: {line}") for x in err.splitlines()), err
    root_cause = err.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1" in root_cause and f"traceback : {line}" in root_cause, err
    assert "error_file: <N/A>" not in root_cause


def test_a_rank_alone_says_it_in_one_line_without_cpp_frames(tmp_path):
    corpus(tmp_path / "node1")
    port = free_port()  # nobody listens: rank 0 was never started
    proc = start([*TINY, "--comm-timeout", "1", "--data", "corpus.txt", "--out", str(tmp_path / "run")],
                 srun_env(1, 2, port), tmp_path / "node1")
    code, err = finish(proc, "rank 1")
    assert code == 1 and err.splitlines() == [
        f"error: rank 1: could not join the job's processes at 127.0.0.1:{port} within --comm-timeout 1 s: The "
        f"client socket has timed out after 1000ms while trying to connect to (127.0.0.1, {port}). (a rank that "
        "never joined printed its own error; is every rank started, with the same MASTER_ADDR/MASTER_PORT?)"], err


def test_a_config_error_is_printed_by_every_rank(cli, monkeypatch):  # noqa: F811
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    err = cli(["--tp", "2", "--pp", "2"])
    assert err.startswith("error: rank 1: ParallelDims(dp=1, tp=2, pp=2, cp=1, ep=1) does not fit 2 ranks")
    assert err.rstrip().endswith("this layout needs 4 processes: torchrun --nproc_per_node=4")


def test_the_error_file_has_torchs_layout(tmp_path, capsys):
    from minidist.train import reporting

    path = tmp_path / "error.json"
    reporting.report("rank 3: something", {reporting.ERROR_FILE: str(path)})
    data = json.loads(path.read_text())
    assert data["message"]["message"] == data["message"]["extraInfo"]["py_callstack"] == "rank 3: something"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure  # torchrun's own reader
    failure = ProcessFailure(local_rank=3, pid=1, exitcode=2, error_file=str(path))
    assert failure.message["extraInfo"]["py_callstack"] == "rank 3: something" and failure.timestamp > 0
    assert capsys.readouterr().err == "error: rank 3: something\n"


# ------------------------------------------------------------------------------------------------------------------
# the command line


@pytest.mark.parametrize("argv, line", [
    (["--comm-timeout", "0.001"], "error: --comm-timeout must be between 1 and 604800 seconds (one week), got 0.001"),
    (["--ckpt-timeout", "0.5"], "error: --ckpt-timeout must be between 1 and 604800 seconds (one week), got 0.5"),
    (["--tp", "2"], "error: ParallelDims(dp=1, tp=2, pp=1, cp=1, ep=1) does not fit 1 ranks: tp=2 does not divide "
                    "world_size=1; tp*pp*cp=2 does not divide 1 either; pick tp, pp, cp whose product divides it; "
                    "this is one process: launch the 2 this layout needs with torchrun --nproc_per_node=2 -m "
                    "minidist.train ..."),
])
def test_bad_settings_are_one_line(cli, tmp_path, argv, line):  # noqa: F811
    assert cli([*argv, "--out", str(tmp_path / "run")]).rstrip() == line


def test_resume_of_an_out_without_a_run_is_refused(cli, tmp_path):  # noqa: F811
    err = cli(["--resume", "--out", str(tmp_path / "does-not-exist")])
    assert "--resume: --out" in err and "holds no run" in err and "leave out --resume" in err
    assert not (tmp_path / "does-not-exist").exists()


def test_a_near_miss_flag_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--batch_size", "4"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --batch_size 4; did you mean --batch-size? "
                                       "(see --help)\n")


def test_help_states_each_default_once():
    text = " ".join(build_parser().format_help().split("options:", 1)[1].split())
    for flag in ("--bucket-mb", "--dp"):
        part = text.split(f"{flag} {flag[2:].upper().replace('-', '_')}", 1)[1].split(" --", 1)[0]
        assert part.count("default") == 1, part


def test_slurm_names_the_variable_that_gave_the_size():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}
    with pytest.raises(ValueError, match=r"^SLURM_PROCID=2 is outside 0..0 \(SLURM_STEP_NUM_TASKS=1\)$"):
        backend.place(env)


def test_main_prints_a_truncated_shard_in_one_line(monkeypatch, capsys):
    from minidist.data.shards import ShardChanged

    def shortened(cfg):
        raise ShardChanged("shard 'D/train_00000.bin' ended at byte 10, before its 100 tokens (shortened since the "
                           "dataset was opened?)")
    monkeypatch.setattr(train, "train", shortened)
    assert train.main(["--out", "unused"]) == 1
    assert capsys.readouterr().err == ("error: shard 'D/train_00000.bin' ended at byte 10, before its 100 tokens "
                                       "(shortened since the dataset was opened?)\n")


def test_an_inconsistent_slurm_ntasks_on_one_rank_is_that_ranks_line(cli, monkeypatch):  # noqa: F811
    for name, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # its peer says 2 tasks; this one 3
    err = cli(["--batch-size", "4"])
    assert err == "error: rank 1: batch_size 4 is not divisible by dp*microbatches = 3*1; pick a multiple of 3\n"


# ------------------------------------------------------------------------------------------------------------------
# a newcomer's first hour


def test_the_readmes_trainer_lines_run_one_after_another():
    """Each line of the README's trainer block that starts a run writes its own OUT: run after `make train` (which
    fills configs/default.toml's), none is refused for an OUT that holds a run. Lines that continue a run
    (--resume) or replace one (--overwrite) are exempt."""
    import shlex
    import tomllib

    text = (ROOT / "README.md").read_text()
    block = text.split("## The trainer", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    default_out = tomllib.loads((ROOT / "configs" / "default.toml").read_text())["out"]
    outs = {default_out: "make train"}
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if "minidist.train" not in words or "--resume" in words or "--overwrite" in words:
            continue
        if "--out" in words:
            out = words[words.index("--out") + 1]
        elif "--config" in words:
            out = tomllib.loads((ROOT / words[words.index("--config") + 1]).read_text()).get("out", "runs/tiny")
        else:
            out = "runs/tiny"  # TrainConfig's default
        assert out not in outs, f"{line!r} writes {out}, as {outs[out]!r} did before it"
        outs[out] = line


def test_make_grade_takes_5_as_05_and_lab_runs_as_root():
    def dry(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under make test
        return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, env=env).stdout

    assert '-k "ch05"' in dry("grade", "CH=5") and '-k "ch12"' in dry("grade", "CH=12")
    lab = dry("lab").splitlines()[-1]
    assert "jupyter lab notebooks" in lab
    shell = subprocess.run(["bash", "-c", f"echo {lab.split('notebooks', 1)[1]}"], capture_output=True, text=True)
    assert ("--allow-root" in shell.stdout) == (os.geteuid() == 0)


def test_the_readmes_outputs_are_ignored_by_git():
    ignored = subprocess.run(["git", "check-ignore", "data/x", "hf/tiny/config.json", "minidist/data/x.py"],
                             cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == ["data/x", "hf/tiny/config.json"]  # the package's own data/ stays tracked


def _gather_and_scatter(_: object) -> list[float]:
    """A rank of run_ranks: the two collectives torch 2.13 deprecates and 2.11 needs, through the package's Comm."""
    import torch

    from minidist.comm.communicator import Comm
    comm = Comm(None)
    gathered = comm.all_gather(torch.ones(2, device="cpu"))
    return comm.reduce_scatter(gathered).tolist()


def test_the_2_11_safe_collectives_print_no_deprecation_warning(tmp_path):
    code = ("from minidist.comm.launch import run_ranks; import test_trust_round_three as t; "
            "print(run_ranks(t._gather_and_scatter, 2, None, timeout=120, threads_per_rank=1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          cwd=ROOT / "tests", env={**base_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"})
    assert done.returncode == 0 and "[[2.0, 2.0], [2.0, 2.0]]" in done.stdout, done.stderr[-2000:]
    assert "FutureWarning" not in done.stderr and "deprecated" not in done.stderr, done.stderr
