"""Launcher detection from synthetic environments (every launcher, the precedence between them, Slurm's
host lists, inconsistent values), the --local_rank strip, and init_distributed in this process: its
timeout, and the store of its own that each torchrun restart meets in."""
import os
import socket
import sys
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gdn_parallel.config import ConfigError
from gdn_parallel.runtime import launch_env
from gdn_parallel.runtime.launch_env import (
    GroupJoinError,
    LaunchEnv,
    LaunchEnvError,
    detect_launch_env,
    expand_hostlist,
    export_launch_env,
    init_distributed,
    parse_tasks_per_node,
    strip_launcher_args,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29600", "TORCHELASTIC_RUN_ID": "none"}
# What the DeepSpeed launcher set on this machine (deepspeed --num_gpus 2), rank 1.
DEEPSPEED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29731", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
# What Open MPI's mpirun set on this machine (mpirun -np 2), rank 1.
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "1"}
HYDRA = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}


@pytest.fixture(autouse=True)
def fresh_mpi_answer():
    launch_env._rank0_hostname_from_mpi.cache_clear()
    yield
    launch_env._rank0_hostname_from_mpi.cache_clear()


def without(environ, *names):
    return {k: v for k, v in environ.items() if k not in names}


# --- one process ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("environ", [
    {}, {"PATH": "/usr/bin"}, {"WORLD_SIZE": "1"}, {"RANK": "0", "WORLD_SIZE": "1"},
    dict(TORCHRUN, RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0"),
    dict(OPEN_MPI, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0",
         OMPI_COMM_WORLD_LOCAL_SIZE="1"),
    dict(SRUN, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NODEID="0",
         SLURM_TASKS_PER_NODE="1"),
    without(SRUN, "SLURM_STEP_ID"),  # the batch script itself, or a bare salloc shell: one process
], ids=["empty", "unrelated", "world-1", "rank-0-world-1", "torchrun-1", "mpirun-np-1", "srun-n-1", "sbatch"])
def test_one_process_is_not_a_launch(environ):
    assert detect_launch_env(environ, []) is None


# --- torchrun, DeepSpeed, by hand ------------------------------------------------------------------------

def test_torchrun():
    assert detect_launch_env(TORCHRUN, []) == LaunchEnv(3, 8, 1, 2, "node01", 29600, "torchrun")


def test_torch_variables_by_hand_default_the_port_and_local_world():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1"}
    assert detect_launch_env(environ, []) == LaunchEnv(1, 2, 0, 2, "10.0.0.1", 29500, "torch-env")


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=1"],
                                  ["--local-rank", "1"]])
def test_deepspeed_with_each_local_rank_form(argv):
    env = detect_launch_env(DEEPSPEED, [*argv, "--steps", "3"])
    assert env == LaunchEnv(1, 2, 1, 2, "127.0.0.1", 29731, "deepspeed")


def test_deepspeed_local_rank_from_argv_when_the_environment_lacks_it():
    env = detect_launch_env(without(DEEPSPEED, "LOCAL_RANK", "CROSS_RANK"), ["--local_rank=1"])
    assert (env.local_rank, env.launcher) == (1, "deepspeed")


def test_deepspeed_with_no_local_rank_is_still_deepspeed():
    assert detect_launch_env(DEEPSPEED, ["--steps", "3"]).launcher == "deepspeed"


@pytest.mark.parametrize("argv,expected", [
    (["--local_rank=1", "--steps", "3"], ["--steps", "3"]),
    (["--steps", "3", "--local_rank", "1"], ["--steps", "3"]),
    (["--local-rank=0", "--set", "train.lr=1e-3"], ["--set", "train.lr=1e-3"]),
    (["--local-rank", "2", "--config", "c.yaml"], ["--config", "c.yaml"]),
    (["--set", "parallel.dp=2"], ["--set", "parallel.dp=2"]),
])
def test_strip_launcher_args(argv, expected):
    assert strip_launcher_args(argv) == expected


# --- MPI ------------------------------------------------------------------------------------------------

def test_open_mpi_on_one_node_needs_no_master_address():
    assert detect_launch_env(OPEN_MPI, []) == LaunchEnv(1, 2, 1, 2, "127.0.0.1", 29500, "openmpi")


def test_open_mpi_takes_master_from_the_environment():
    env = detect_launch_env(dict(OPEN_MPI, MASTER_ADDR="head", MASTER_PORT="1234"), [])
    assert (env.master_addr, env.master_port) == ("head", 1234)


def two_nodes(environ):
    return dict(environ, OMPI_COMM_WORLD_SIZE="4")  # 2 ranks on this node, 4 in all


def test_open_mpi_over_nodes_without_mpi4py_asks_for_master_addr(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails
    with pytest.raises(LaunchEnvError, match="set MASTER_ADDR.*mpirun -x MASTER_ADDR.*mpi4py"):
        detect_launch_env(two_nodes(OPEN_MPI), [])


def fake_mpi4py(monkeypatch, rank0_host):
    calls = []

    def bcast(value, root):
        calls.append((value, root))
        return rank0_host
    mpi = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(bcast=bcast))
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return calls


def test_open_mpi_over_nodes_broadcasts_rank0_host_with_mpi4py(monkeypatch):
    calls = fake_mpi4py(monkeypatch, "rank0-host")
    assert detect_launch_env(two_nodes(OPEN_MPI), []).master_addr == "rank0-host"
    assert detect_launch_env(two_nodes(OPEN_MPI), []).master_addr == "rank0-host"
    assert calls == [(socket.gethostname(), 0)]  # one collective, however often detection runs


def test_broken_mpi_launch_fails_before_the_collective(monkeypatch):
    calls = fake_mpi4py(monkeypatch, "rank0-host")
    with pytest.raises(LaunchEnvError, match="OMPI_COMM_WORLD_RANK=4"):
        detect_launch_env(dict(two_nodes(OPEN_MPI), OMPI_COMM_WORLD_RANK="4"), [])
    assert calls == []


def test_hydra_pmi():
    env = detect_launch_env(dict(HYDRA, MASTER_ADDR="node01"), [])
    assert env == LaunchEnv(5, 8, 1, 4, "node01", 29500, "pmi")


def test_hydra_on_one_node():
    env = detect_launch_env(dict(HYDRA, PMI_RANK="1", PMI_SIZE="4"), [])
    assert (env.rank, env.master_addr, env.launcher) == (1, "127.0.0.1", "pmi")


def test_srun_with_pmi2_is_read_as_the_slurm_step():
    env = detect_launch_env(dict(SRUN, PMI_RANK="5", PMI_SIZE="8"), [])
    assert (env.launcher, env.rank, env.master_addr) == ("slurm", 5, "gpu07")


# --- Slurm ----------------------------------------------------------------------------------------------

def test_srun_step():
    assert detect_launch_env(SRUN, []) == LaunchEnv(5, 8, 1, 4, "gpu07", 15000 + 123456 % 10000, "slurm")


def test_srun_concurrent_jobs_get_different_ports():
    ports = {detect_launch_env(dict(SRUN, SLURM_JOB_ID=str(job)), []).master_port for job in (100, 101, 102)}
    assert len(ports) == 3


def test_srun_master_from_environment_wins():
    env = detect_launch_env(dict(SRUN, MASTER_ADDR="head", MASTER_PORT="4242"), [])
    assert (env.master_addr, env.master_port) == ("head", 4242)


def test_srun_uneven_tasks_per_node_and_old_variable_names():
    environ = {"SLURM_JOBID": "7", "SLURM_STEPID": "1", "SLURM_PROCID": "8", "SLURM_NPROCS": "9",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "4(x2),1",
               "SLURM_NODELIST": "a[1-2],b5"}
    assert detect_launch_env(environ, []) == LaunchEnv(8, 9, 0, 1, "a1", 15007, "slurm")


def test_srun_tasks_per_node_from_ntasks_per_node():
    environ = dict(without(SRUN, "SLURM_TASKS_PER_NODE"), SLURM_NTASKS_PER_NODE="4")
    assert detect_launch_env(environ, []).local_world_size == 4


def test_srun_step_list_wins_over_the_jobs():
    environ = dict(SRUN, SLURM_STEP_NODELIST="gpu08", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4",
                   SLURM_PROCID="2", SLURM_NODEID="0")
    env = detect_launch_env(environ, [])
    assert (env.world_size, env.local_world_size, env.master_addr) == (4, 4, "gpu08")


@pytest.mark.parametrize("hostlist,hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("a[1-2],b[09-11]", ["a1", "a2", "b09", "b10", "b11"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("node-ib[3],x", ["node-ib3", "x"]),
    ("h1.cluster.org,h2.cluster.org", ["h1.cluster.org", "h2.cluster.org"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[01-", "node[3-1]", "node[a]", "node]1[", "n[[1]]"])
def test_malformed_hostlist_is_an_error(hostlist):
    with pytest.raises(LaunchEnvError, match="host list"):
        expand_hostlist(hostlist)


@pytest.mark.parametrize("spec,counts", [("4(x2),3", [4, 4, 3]), ("8", [8]), ("2(x3)", [2, 2, 2])])
def test_parse_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec) == counts


def test_malformed_tasks_per_node_is_an_error():
    with pytest.raises(LaunchEnvError, match="4x2"):
        detect_launch_env(dict(SRUN, SLURM_TASKS_PER_NODE="4x2"), [])


# --- precedence: the innermost launcher wins -------------------------------------------------------------

def test_torchrun_under_srun_is_torchrun():
    srun_one_task_per_node = dict(SRUN, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0",
                                  SLURM_TASKS_PER_NODE="1(x2)")
    assert detect_launch_env({**srun_one_task_per_node, **TORCHRUN}, []).launcher == "torchrun"


def test_mpirun_inside_an_allocation_is_mpi():
    daemon_step = dict(SRUN, SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0",
                       SLURM_TASKS_PER_NODE="1(x2)")
    assert detect_launch_env({**daemon_step, **OPEN_MPI}, []).launcher == "openmpi"
    assert detect_launch_env({**daemon_step, **HYDRA, "MASTER_ADDR": "h"}, []).launcher == "pmi"


# --- inconsistent or missing values name the variable ----------------------------------------------------

@pytest.mark.parametrize("environ,argv,message", [
    (dict(TORCHRUN, RANK="8"), [], r"RANK=8 must be in \[0, WORLD_SIZE=8\)"),
    (without(TORCHRUN, "WORLD_SIZE"), [], "WORLD_SIZE is not set"),
    (without(TORCHRUN, "RANK"), [], "RANK is not set"),
    (without(TORCHRUN, "LOCAL_RANK"), [], "LOCAL_RANK is not set"),
    (without(TORCHRUN, "MASTER_ADDR"), [], "MASTER_ADDR is not set"),
    (dict(TORCHRUN, WORLD_SIZE="eight"), [], "WORLD_SIZE='eight' is not an integer"),
    (dict(TORCHRUN, LOCAL_RANK="2"), [], r"LOCAL_RANK=2 must be in \[0, LOCAL_WORLD_SIZE=2\)"),
    (dict(TORCHRUN, LOCAL_WORLD_SIZE="16"), [], r"LOCAL_WORLD_SIZE=16 must be in \[1, WORLD_SIZE=8\]"),
    (dict(TORCHRUN, MASTER_PORT="70000"), [], "MASTER_PORT gives port 70000"),
    (DEEPSPEED, ["--local_rank=0"], "LOCAL_RANK=1 but the command line has --local_rank=0"),
    (DEEPSPEED, ["--local_rank"], "--local_rank needs an integer"),
    (without(OPEN_MPI, "OMPI_COMM_WORLD_SIZE"), [], "OMPI_COMM_WORLD_SIZE is not set"),
    (dict(OPEN_MPI, OMPI_COMM_WORLD_RANK="2"), [],
     r"OMPI_COMM_WORLD_RANK=2 must be in \[0, OMPI_COMM_WORLD_SIZE=2\)"),
    (without(HYDRA, "PMI_SIZE"), [], "PMI_SIZE is not set"),
    (without(HYDRA, "MPI_LOCALRANKID"), [], "MPI_LOCALRANKID / PALS_LOCAL_RANKID is not set; launch with"),
    (dict(SRUN, SLURM_PROCID="8"), [], r"SLURM_PROCID=8 must be in \[0, SLURM_NTASKS=8\)"),
    (without(SRUN, "SLURM_NTASKS"), [], "SLURM_STEP_NUM_TASKS / SLURM_NTASKS / SLURM_NPROCS is not set"),
    (without(SRUN, "SLURM_LOCALID"), [], "SLURM_LOCALID is not set"),
    (dict(SRUN, SLURM_LOCALID="4"), [], r"SLURM_LOCALID=4 must be in \[0, SLURM_TASKS_PER_NODE=4\)"),
    (dict(SRUN, SLURM_NODEID="2"), [], "SLURM_NODEID=2 but SLURM_TASKS_PER_NODE='4\\(x2\\)' lists 2 nodes"),
    (without(SRUN, "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"), [], "SLURM_STEP_NODELIST.*set MASTER_ADDR"),
])
def test_inconsistent_launch_names_the_variable(environ, argv, message):
    with pytest.raises(LaunchEnvError, match=message):
        detect_launch_env(environ, argv)


def test_launch_errors_are_config_errors():
    """The trainer reports ConfigError as a usage error (exit 2, the message), launch errors included."""
    assert issubclass(LaunchEnvError, ConfigError)


# --- setting up the process group -----------------------------------------------------------------------

def test_export_writes_torch_variables(monkeypatch):
    for name in launch_env.TORCH_VARIABLES:
        monkeypatch.setenv(name, "stale")  # restored after the test
    export_launch_env(LaunchEnv(5, 8, 1, 4, "gpu07", 15456, "slurm"))
    assert {name: os.environ[name] for name in launch_env.TORCH_VARIABLES} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "15456"}


@pytest.mark.parametrize("visible,local_rank,index", [(8, 3, 3), (1, 3, 0), (4, 0, 0)])
def test_gpu_of_a_local_rank(monkeypatch, visible, local_rank, index):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    env = LaunchEnv(local_rank, 8, local_rank, 8, "h", 1, "torchrun")
    assert launch_env._cuda_device(env) == torch.device("cuda", index)


def test_local_rank_without_a_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LaunchEnvError, match="local rank 3 has no GPU.*CUDA_VISIBLE_DEVICES"):
        launch_env._cuda_device(LaunchEnv(3, 8, 3, 4, "h", 1, "slurm"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_distributed_joins_a_group(monkeypatch):
    """A group of one through env:// on this machine: gloo on CPU (NCCL and the GPU under CUDA)."""
    for name in launch_env.TORCH_VARIABLES:
        monkeypatch.setenv(name, "stale")
    assert not dist.is_initialized()
    device = init_distributed(LaunchEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "torch-env"), timeout_s=60)
    try:
        assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        assert value.item() == 1
    finally:
        dist.destroy_process_group()


def test_a_cuda_group_is_bound_to_its_rank_device(monkeypatch):
    """On CUDA the group is formed with device_id: torch then knows every barrier's device (without it
    each barrier warned on every rank, 24 lines in one 2-GPU gdn-verify) and NCCL connects at start-up.
    A CPU group gets no device_id."""
    calls = []
    monkeypatch.setattr(launch_env, "_store_of_this_attempt", lambda env, timeout: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(("barrier", kw)))
    env = LaunchEnv(1, 2, 1, 2, "127.0.0.1", 1, "torchrun")
    launch_env._join(env, "nccl", timedelta(seconds=5), torch.device("cuda", 1))
    assert calls[0][2]["device_id"] == torch.device("cuda", 1)
    assert calls[1] == ("barrier", {"device_ids": [1]})
    calls.clear()
    launch_env._join(env, "gloo", timedelta(seconds=5), torch.device("cpu"))
    assert "device_id" not in calls[0][2]


TORCHRUN_RESTARTS = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                     "TORCHELASTIC_MAX_RESTARTS")


def test_a_rank_whose_peer_never_comes_fails_within_the_timeout_saying_what_to_do(monkeypatch):
    """Rank 0 of 2 alone (env://: it hosts the store and waits for rank 1): a GroupJoinError after
    timeout_s, not torch's 30 minutes, naming the field and torchrun's next restart."""
    for name in launch_env.TORCH_VARIABLES + TORCHRUN_RESTARTS:
        monkeypatch.setenv(name, "stale")  # restored afterwards: init_distributed exports the launch
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    start = time.monotonic()
    with pytest.raises(GroupJoinError, match=r"(?s)rank 0/2 .* could not join the process group within "
                                             r"train.collective_timeout_s=2 s: .*torchrun now restarts every "
                                             r"rank \(restart 2 of --max-restarts=2\); with --resume auto"):
        init_distributed(LaunchEnv(0, 2, 0, 2, "127.0.0.1", free_port(), "torchrun"), timeout_s=2)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


def test_each_torchrun_restart_meets_in_a_store_of_its_own(monkeypatch):
    """torchrun's agent keeps its store's keys across restarts: what the killed attempt's ranks wrote
    there (their gloo addresses) must not reach the restarted ones."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    env, timeout = LaunchEnv(0, 2, 0, 2, "127.0.0.1", port, "torchrun"), timedelta(seconds=10)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch_env._store_of_this_attempt(env, timeout).set("rank1_address", "of the killed attempt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = launch_env._store_of_this_attempt(env, timeout)
    assert not restarted.check(["rank1_address"])
    restarted.set("rank1_address", "of the restarted attempt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert launch_env._store_of_this_attempt(env, timeout).get("rank1_address") == b"of the killed attempt"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "one")
    with pytest.raises(LaunchEnvError, match="TORCHELASTIC_RESTART_COUNT='one' is not an integer"):
        launch_env._store_of_this_attempt(env, timeout)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert launch_env._store_of_this_attempt(env, timeout) is None  # other launchers: env:// as it is
    del agent_store


@pytest.mark.parametrize("env, environ, cores, threads", [
    (LaunchEnv(1, 2, 1, 2, "h", 1, "deepspeed"), {}, 2, 1),            # the issue: 2 processes on 2 cores
    (LaunchEnv(1, 16, 1, 8, "h", 1, "deepspeed"), {}, 64, 8),
    (LaunchEnv(1, 4, 1, 4, "h", 1, "openmpi"), {}, 3, 1),              # never below one thread
    (LaunchEnv(1, 2, 1, 2, "h", 1, "torchrun"), {"OMP_NUM_THREADS": "1"}, 2, None),   # torchrun's export
    (LaunchEnv(1, 2, 1, 2, "h", 1, "deepspeed"), {"OMP_NUM_THREADS": "4"}, 2, None),  # the user's choice
    (LaunchEnv(1, 8, 1, 4, "h", 1, "slurm"), {}, 8, None),             # srun binds each task's CPUs
    (LaunchEnv(1, 2, 0, 1, "h", 1, "deepspeed"), {}, 8, None),         # alone on its node
])
def test_cpu_threads_per_process_shares_the_cores_of_a_node(env, environ, cores, threads):
    assert launch_env.cpu_threads_per_process(env, environ, cores) == threads
