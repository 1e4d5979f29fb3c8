"""Which launcher started this process, and the torch.distributed set-up that follows from it.

    env = detect_launch_env()                  # None: one plain process
    argv = strip_launcher_args(sys.argv[1:])   # DeepSpeed's --local_rank=N is not the trainer's option
    if env is not None:
        # exports RANK, ...; init_process_group
        device = init_distributed(env, config.train.collective_timeout_s)

Launchers, in order of precedence (the first whose variables are present wins):

  1. torch.distributed's variables RANK and WORLD_SIZE (with LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
     MASTER_PORT): torchrun, or the DeepSpeed launcher, which sets them too (LOCAL_SIZE for the local
     world) and passes `--local_rank=N` on the command line, or a user by hand.
  2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
  3. PMI (MPICH and Intel MPI's Hydra, Cray PALS): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (or
     PALS_LOCAL_RANKID), MPI_LOCALNRANKS (or PALS_LOCAL_SIZE). PMI_RANK without those inside an srun
     step (srun --mpi=pmi2) is read as that Slurm step.
  4. Slurm, inside an srun step (SLURM_STEP_ID set): SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS,
     SLURM_LOCALID, tasks per node from SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE (forms like
     "4(x2),3"), else SLURM_NTASKS_PER_NODE.

Why this order: launchers nest, and the innermost one describes the worker processes. torchrun or
DeepSpeed under srun run one Slurm task per node; mpirun inside an allocation starts its daemons with
srun, so its ranks inherit a per-node task's SLURM_*. A batch script or a bare salloc shell carries
SLURM_PROCID too but is one process, hence Slurm counts only inside an srun step.

MASTER_ADDR and MASTER_PORT from the environment always win. Otherwise Slurm takes the first host of the
step's node list (rank 0's node under the default block distribution) and a port derived from
SLURM_JOB_ID, so that concurrent jobs on one node differ. MPI takes 127.0.0.1 when every rank is on one
node, else rank 0's hostname broadcast with mpi4py when it imports (a collective: every rank must reach
its first detect_launch_env; later calls reuse the answer), else it fails asking for MASTER_ADDR. The
other launchers' port defaults to 29500.

A launch of a single process (world size 1) is a plain single process: detect_launch_env returns None.

CPU threads: torchrun exports OMP_NUM_THREADS=1 to the processes of a node; DeepSpeed's launcher and
mpirun export nothing, and each of their processes took every core (2 processes on 2 cores: 2 threads
each). init_distributed therefore shares the cores this process may run on among the node's processes
when OMP_NUM_THREADS is unset (cpu_threads_per_process); OMP_NUM_THREADS, when set, and a positive
train.threads (set later by the trainer) win. Slurm is left alone: srun binds each task to its
--cpus-per-task CPUs, which torch's default already counts.

Under torchrun the group meets in the agent's store through a prefix of its own per restart
(TORCHELASTIC_RESTART_COUNT): the agent keeps its store's keys from one restart to the next, and a
restarted group must not read the addresses of the group it replaces (_store_of_this_attempt).
"""
from __future__ import annotations

import functools
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ConfigError, TrainConfig
from .waiting import waiting_line, waiting_notices

DEFAULT_MASTER_PORT = 29500
# Slurm's default port: SLURM_PORT_BASE + job id % SLURM_PORT_SPAN, below Linux's ephemeral ports (32768+).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchEnvError(ConfigError):
    """The launcher's variables are missing or contradict each other; the message names the variable."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | deepspeed | torch-env | openmpi | pmi | slurm

    def __str__(self) -> str:
        return (f"{self.launcher}: rank {self.rank}/{self.world_size} (local {self.local_rank}/"
                f"{self.local_world_size}), master {self.master_addr}:{self.master_port}")


def detect_launch_env(environ: Mapping[str, str] | None = None,
                      argv: Sequence[str] | None = None) -> LaunchEnv | None:
    """The launch this process is part of (precedence: the module docstring), or None for one process.
    environ defaults to os.environ, argv to sys.argv[1:]. Raises LaunchEnvError naming the variable."""
    environ = os.environ if environ is None else environ
    argv = sys.argv[1:] if argv is None else argv
    for parse in (_torch_launch, _open_mpi_launch, _pmi_launch, _slurm_launch):
        env = parse(environ, argv)
        if env is not None:
            return env if env.world_size > 1 else None
    return None


def is_first_process() -> bool:
    """Rank 0 of a launch, or a plain process: every process of a launch resolves the same config, and
    one of them says what it noted."""
    launch = detect_launch_env()
    return launch is None or launch.rank == 0


def say_on_first_process(line: str) -> None:
    if is_first_process():
        print(line, flush=True)


def strip_launcher_args(argv: Sequence[str]) -> list[str]:
    """argv without the launcher's `--local_rank=N`, `--local_rank N` (or `--local-rank`): DeepSpeed
    passes it, the trainer's parser does not know it, and LOCAL_RANK carries the same number."""
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
            if _is_int(arg):
                continue
        if arg in LOCAL_RANK_FLAGS:
            skip_value = True
        elif not arg.startswith(tuple(flag + "=" for flag in LOCAL_RANK_FLAGS)):
            kept.append(arg)
    return kept


def export_launch_env(env: LaunchEnv) -> None:
    """Write env into os.environ under torch.distributed's names, which env:// initialisation reads."""
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size), MASTER_ADDR=env.master_addr,
                      MASTER_PORT=str(env.master_port))


class GroupJoinError(RuntimeError):
    """This rank could not form the process group with its peers within the timeout; the message says
    which rank, where it waited, and what to do."""


def init_distributed(env: LaunchEnv, timeout_s: float = TrainConfig.collective_timeout_s) -> torch.device:
    """Join the process group of env: NCCL with GPU local_rank when CUDA is available, else gloo on the
    CPU. Returns this process's device. timeout_s (train.collective_timeout_s) bounds every collective
    of the group, joining it included; a join that fails raises GroupJoinError. The node's CPU cores are
    shared among its processes where the launcher did not share them (cpu_threads_per_process)."""
    export_launch_env(env)
    cuda = torch.cuda.is_available()
    device = _cuda_device(env) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
    address = f"{env.master_addr}:{env.master_port}"
    try:
        # A rank whose peers have not started says so while it waits (runtime/waiting.py).
        with waiting_notices(lambda waited: waiting_line(env.rank, env.world_size, address, waited,
                                                         timeout_s)):
            _join(env, backend, timeout, device)
    except RuntimeError as err:  # the store's and the backends' errors (torch.distributed.DistError, gloo's)
        raise GroupJoinError(f"{env}: could not join the process group within train.collective_timeout_s="
                             f"{timeout_s:g} s: {err}\n{restart_advice()}") from err
    threads = cpu_threads_per_process(env)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)   # for child processes, as torchrun's export
        torch.set_num_threads(threads)
    return device


def _join(env: LaunchEnv, backend: str, timeout: timedelta, device: torch.device) -> None:
    """Form the group and meet every peer once, so that the start-up wait ends here on every backend.
    On CUDA the group is bound to this rank's device (device_id): its barriers then need no guess of
    the device (torch warned at each one) and NCCL connects now, not inside the first step."""
    store = _store_of_this_attempt(env, timeout)
    bound = {"device_id": device} if device.type == "cuda" else {}
    if store is None:
        dist.init_process_group(backend, timeout=timeout, **bound)
    else:
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **bound)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def cpu_threads_per_process(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                            cores: int | None = None) -> int | None:
    """torch's CPU threads for one of env's processes: the cores this process may run on (`cores`,
    default its CPU affinity) over the processes of its node, at least 1; None to leave torch's
    default: OMP_NUM_THREADS is set (torchrun's or the user's choice), a Slurm task (bound to its own
    CPUs), or the only process of its node (module docstring)."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip() or env.launcher == "slurm" or env.local_world_size == 1:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // env.local_world_size)


def restart_advice() -> str:
    """What a user can do after a rank of this job failed, and what torchrun does next by itself."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    cause = ("A peer process ended (killed, crashed, out of memory) or is stuck: the first error in the "
             "other ranks' output is the cause.")
    if _is_int(restarts) and _is_int(limit) and int(restarts) < int(limit):
        return (f"{cause} torchrun now restarts every rank (restart {int(restarts) + 1} of "
                f"--max-restarts={limit}); "
                f"with --resume auto the job continues from the newest checkpoint under train.out_dir.")
    return (f"{cause} Start the job again with --resume auto to continue from the newest checkpoint under "
            f"train.out_dir (torchrun --max-restarts=N does that by itself).")


# torchrun's agent hosts the TCPStore its workers meet in (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it,
# keys included, from one restart to the next, under both its static and its c10d rendezvous; torch's
# env:// joins it without a per-attempt prefix (torch 2.13). A restarted worker could then read the
# previous attempt's gloo addresses (or NCCL id) before its new peer overwrote them: connectFullMesh failed
# with "Connection refused" (a lost restart) or waited in Pair::waitUntilConnected for the whole timeout.
AGENT_STORE_PREFIX = "gdn_parallel/restart_{}/"


def _store_of_this_attempt(env: LaunchEnv, timeout: timedelta) -> dist.Store | None:
    """torchrun's store seen through a prefix of its own per restart (TORCHELASTIC_RESTART_COUNT: one
    count per agent, the same for the ranks it restarts together), or None outside torchrun (env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restart, _ = _Reader(os.environ, env.launcher).int("TORCHELASTIC_RESTART_COUNT", default=0)
    agent_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                                timeout=timeout)
    return dist.PrefixStore(AGENT_STORE_PREFIX.format(restart), agent_store)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, e.g. "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5
    (zero padding kept; several brackets in one name multiply: "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2)."""
    hosts: list[str] = []
    for name in _split_outside_brackets(hostlist.strip()):
        hosts.extend(_expand_name(name, hostlist))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks per node, e.g. "4(x2),3" -> [4, 4, 3]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchEnvError(f"cannot read tasks per node {spec!r}: expected items like 4 or 4(x2)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


# --- one parser per launcher: None when its variables are absent ---------------------------------------

def _torch_launch(environ: Mapping[str, str], argv: Sequence[str]) -> LaunchEnv | None:
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    argv_local_rank = _local_rank_from_argv(argv)
    launcher = ("deepspeed" if argv_local_rank is not None or "CROSS_RANK" in environ
                else "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "torch-env")
    read = _Reader(environ, launcher)
    world, world_name = read.int("WORLD_SIZE")
    rank, rank_name = read.int("RANK", default=0 if world == 1 else None)
    if world == 1 and rank == 0:  # one process (WORLD_SIZE=1 exported, torchrun --nproc_per_node=1)
        return LaunchEnv(0, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, launcher)
    if "LOCAL_RANK" in environ:
        local_rank, local_name = read.int("LOCAL_RANK")
        if argv_local_rank is not None and argv_local_rank != local_rank:
            raise LaunchEnvError(f"LOCAL_RANK={local_rank} but the command line has --local_rank="
                                 f"{argv_local_rank}: start the process with one local rank")
    elif argv_local_rank is not None:
        local_rank, local_name = argv_local_rank, "--local_rank"
    else:
        local_rank, local_name = read.int("LOCAL_RANK")  # raises: missing
    local_world, local_world_name = read.int("LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=world)
    master_addr = read.text("MASTER_ADDR")
    master_port, port_name = read.int("MASTER_PORT", default=DEFAULT_MASTER_PORT)
    return _checked(launcher, rank, world, local_rank, local_world, master_addr, master_port,
                    (rank_name, world_name, local_name, local_world_name, port_name))


def _open_mpi_launch(environ: Mapping[str, str], argv: Sequence[str]) -> LaunchEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    read = _Reader(environ, "openmpi")
    return _mpi_env(read, read.int("OMPI_COMM_WORLD_RANK"), read.int("OMPI_COMM_WORLD_SIZE"),
                    read.int("OMPI_COMM_WORLD_LOCAL_RANK"), read.int("OMPI_COMM_WORLD_LOCAL_SIZE"))


def _pmi_launch(environ: Mapping[str, str], argv: Sequence[str]) -> LaunchEnv | None:
    if "PMI_RANK" not in environ:
        return None
    read = _Reader(environ, "pmi")
    if read.first_set("MPI_LOCALRANKID", "PALS_LOCAL_RANKID") is None and _slurm_step(environ):
        return None  # srun --mpi=pmi2 sets PMI_RANK too: the Slurm parser reads that step, node list included
    local_rank = read.int("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")
    local_world = read.int("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE")
    return _mpi_env(read, read.int("PMI_RANK"), read.int("PMI_SIZE"), local_rank, local_world)


def _slurm_launch(environ: Mapping[str, str], argv: Sequence[str]) -> LaunchEnv | None:
    if "SLURM_PROCID" not in environ or not _slurm_step(environ):
        return None
    read = _Reader(environ, "slurm")
    world, world_name = read.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    rank, rank_name = read.int("SLURM_PROCID")
    local_rank, local_name = read.int("SLURM_LOCALID")
    local_world, local_world_name = _slurm_tasks_on_this_node(read)
    if read.first_set("MASTER_ADDR"):
        master_addr = read.text("MASTER_ADDR")
    else:
        nodelist = read.text("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        master_addr = expand_hostlist(nodelist)[0]
    if read.first_set("MASTER_PORT"):
        master_port, port_name = read.int("MASTER_PORT")
    else:
        job_id, port_name = read.int("SLURM_JOB_ID", "SLURM_JOBID")
        master_port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return _checked("slurm", rank, world, local_rank, local_world, master_addr, master_port,
                    (rank_name, world_name, local_name, local_world_name, port_name))


def _slurm_step(environ: Mapping[str, str]) -> bool:
    """Inside an srun step: srun sets SLURM_STEP_ID, a batch script or a bare salloc shell does not."""
    return "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ


def _slurm_tasks_on_this_node(read: _Reader) -> tuple[int, str]:
    spec_name = read.first_set("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec_name is None:
        return read.int("SLURM_NTASKS_PER_NODE")
    counts = parse_tasks_per_node(read.environ[spec_name])
    node, node_name = read.int("SLURM_NODEID", default=0)
    if not 0 <= node < len(counts):
        raise LaunchEnvError(f"slurm launch: {node_name}={node} but {spec_name}="
                             f"{read.environ[spec_name]!r} lists {len(counts)} nodes")
    return counts[node], spec_name


def _mpi_env(read: _Reader, rank: tuple[int, str], world: tuple[int, str], local_rank: tuple[int, str],
             local_world: tuple[int, str]) -> LaunchEnv:
    names = (rank[1], world[1], local_rank[1], local_world[1], "MASTER_PORT")
    master_port, _ = read.int("MASTER_PORT", default=DEFAULT_MASTER_PORT)
    # Check the numbers first: a broken launch must not reach the mpi4py collective below.
    _checked(read.launcher, rank[0], world[0], local_rank[0], local_world[0], "unknown", master_port, names)
    if read.first_set("MASTER_ADDR"):
        master_addr = read.text("MASTER_ADDR")
    elif local_world[0] == world[0]:
        master_addr = "127.0.0.1"  # every rank on this node
    else:
        master_addr = _rank0_hostname_from_mpi()
        if master_addr is None:
            raise LaunchEnvError(
                f"{read.launcher} launch over several nodes: set MASTER_ADDR to the host of rank 0 (the "
                f"first host of your hostfile) and pass it to every rank (Open MPI: mpirun -x MASTER_ADDR; "
                f"MPICH / Intel MPI: -genv MASTER_ADDR), or `pip install mpi4py` to find it through MPI")
    return _checked(read.launcher, rank[0], world[0], local_rank[0], local_world[0], master_addr, master_port,
                    names)


@functools.cache
def _rank0_hostname_from_mpi() -> str | None:
    """Rank 0's hostname on every rank, through MPI; None when mpi4py is not installed. A collective, run
    once: every rank reaches the first call, later calls (a second detect_launch_env) reuse its answer."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def _checked(launcher: str, rank: int, world: int, local_rank: int, local_world: int, master_addr: str,
             master_port: int, names: tuple[str, str, str, str, str]) -> LaunchEnv:
    rank_name, world_name, local_name, local_world_name, port_name = names
    where = f"{launcher} launch"
    if world < 1:
        raise LaunchEnvError(f"{where}: {world_name}={world} must be at least 1")
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{where}: {rank_name}={rank} must be in [0, {world_name}={world})")
    if not 1 <= local_world <= world:
        raise LaunchEnvError(f"{where}: {local_world_name}={local_world} must be in "
                             f"[1, {world_name}={world}]")
    if not 0 <= local_rank < local_world:
        raise LaunchEnvError(f"{where}: {local_name}={local_rank} must be in "
                             f"[0, {local_world_name}={local_world})")
    if not 0 < master_port < 65536:
        raise LaunchEnvError(f"{where}: {port_name} gives port {master_port}, outside 1..65535")
    return LaunchEnv(rank, world, local_rank, local_world, master_addr, master_port, launcher)


class _Reader:
    """Reads a launcher's variables; every error names the variable and the launcher."""

    def __init__(self, environ: Mapping[str, str], launcher: str):
        self.environ, self.launcher = environ, launcher

    def first_set(self, *names: str) -> str | None:
        return next((name for name in names if self.environ.get(name, "").strip()), None)

    def text(self, *names: str) -> str:
        name = self.first_set(*names)
        if name is None:
            raise LaunchEnvError(f"{self.launcher} launch: {' / '.join(names)} is not set; "
                                 f"{_HOW_TO_SET.get(names[0], 'set it for every process')}")
        return self.environ[name].strip()

    def int(self, *names: str, default: int | None = None) -> tuple[int, str]:
        """(value, the variable it came from); default when none is set, else an error if no default."""
        if default is not None and self.first_set(*names) is None:
            return default, names[0]
        name = self.first_set(*names)
        raw = self.text(*names)
        if not _is_int(raw):
            raise LaunchEnvError(f"{self.launcher} launch: {name}={raw!r} is not an integer")
        return int(raw), name


_HOW_TO_SET: dict[str, str] = {
    "MASTER_ADDR": "set it to the host of rank 0 on every process",
    "LOCAL_RANK": "set it to the process's index on its node (the launcher normally does)",
    "WORLD_SIZE": "set it to the number of processes (RANK alone does not make a launch)",
    "RANK": "set it to the process's global index, 0 .. WORLD_SIZE - 1",
    "SLURM_STEP_NODELIST": "srun sets it; or set MASTER_ADDR to the host of rank 0",
    "MPI_LOCALRANKID": "launch with mpiexec (Hydra), which sets it, or set it to the rank's index on its "
                       "node",
    "MPI_LOCALNRANKS": "launch with mpiexec (Hydra), which sets it, or set it to the ranks on this node",
}


def _local_rank_from_argv(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag not in LOCAL_RANK_FLAGS:
            continue
        if not value and arg == flag:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if not _is_int(value):
            raise LaunchEnvError(f"command line: {flag} needs an integer, got {value!r}")
        return int(value)
    return None


def _is_int(text: str) -> bool:
    return re.fullmatch(r"\s*[+-]?\d+\s*", text) is not None


def _cuda_device(env: LaunchEnv) -> torch.device:
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES", "")
    # A launcher that binds one GPU per process (srun --gpus-per-task=1) leaves each process one device.
    index = 0 if count == 1 else env.local_rank
    if index >= count:
        raise LaunchEnvError(f"{env.launcher} launch: local rank {env.local_rank} has no GPU: this process "
                             f"sees {count} (CUDA_VISIBLE_DEVICES={visible!r}); "
                             f"start at most {count} processes per node")
    return torch.device("cuda", index)


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise LaunchEnvError(f"cannot read host list {text!r}: unbalanced or nested brackets")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchEnvError(f"cannot read host list {text!r}: a '[' is not closed")
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_name(name: str, hostlist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    return [head + number + rest for number in _expand_ranges(match.group(1), hostlist)
            for rest in _expand_name(tail, hostlist)]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    numbers: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise LaunchEnvError(f"cannot read host list {hostlist!r}: {item!r} is not N or N-M with N <= M")
        first, last = match.group(1), match.group(2) or match.group(1)
        numbers.extend(str(n).zfill(len(first)) for n in range(int(first), int(last) + 1))
    return numbers
