"""The process group a job runs in, for every world size, and the device it uses.

Under a launcher (torchrun, DeepSpeed, Slurm, mpirun) the group spans the launched processes; a
plain `python -m gdn_parallel.train` gets a group of one (an in-memory store, no port), so that one
training loop serves every world size. A group that already exists (a test's workers, a host
program) is used as it is and left open.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ConfigError


def resolve_device(name: str) -> torch.device:
    """train.device of a single-process run: auto, cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"train.device={name!r} is not a device: {err}; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is available; use auto or cpu")
    return device


def is_launched() -> bool:
    """Whether a launcher started several processes (its environment names the world size)."""
    from .launch_env import detect_launch_env
    env = detect_launch_env()
    return env is not None and env.world_size > 1


@contextlib.contextmanager
def process_group(train_config) -> Iterator[tuple[torch.device, bool]]:
    """(device, launched): the group this process trains in is open inside the block. Its collectives,
    joining it included, wait train.collective_timeout_s for a peer before failing; a communication
    failure inside the block is raised with a note saying what happened and what to do."""
    if dist.is_initialized():  # given by the caller: use it, leave it open
        yield _device_of_group(train_config), dist.get_world_size() > 1
        return
    from .launch_env import detect_launch_env, init_distributed, restart_advice
    timeout_s = train_config.collective_timeout_s
    env = detect_launch_env()
    if env is not None and env.world_size > 1:
        device = init_distributed(env, timeout_s)
        launched = True
    else:
        device = resolve_device(train_config.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        bound = {}
        if device.type == "cuda":
            if device.index is not None:
                torch.cuda.set_device(device)
            # bound to its device, as a launched job's group is (launch_env._join): the barriers at the
            # end then need no guess of the device, which torch warned about twice after every run
            bound = {"device_id": torch.device("cuda", torch.cuda.current_device())}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s), **bound)
        launched = False
    finished = False
    try:
        yield device, launched
        _settle_collectives()
        finished = True
    except RuntimeError as err:
        if launched and is_communication_failure(err):
            raise PeerLost(f"rank {dist.get_rank()}: a collective with the other ranks failed (a peer ended, "
                           f"or did not answer within train.collective_timeout_s={timeout_s:g} s: "
                           f"{_first_line(err)}). {restart_advice()}") from err
        raise
    finally:
        _watch_the_end()
        _close_group(finished)


def _close_group(finished: bool) -> None:
    """The job's groups closed. NCCL's are aborted, not destroyed: destroy_process_group waits for
    every communicator to flush, one group after another, and a 1M run under cp 4 (a two-rank group per
    neighbouring pair beside the world's) sat there for minutes after its summary on 4 H200s
    (2026-11-28, twice, warm caches or cold); torch's abort closes them all inside one NCCL group, which
    does not wait on the peers. After a finished job the ranks first wait for each other and for their
    GPUs, so that nothing is in flight when the communicators go; after a failure there is nothing to
    keep, and a dead peer would never answer."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.get_backend() != "nccl" or abort is None:
        dist.destroy_process_group()
        return
    if finished:
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
    abort()


END_STACKS_AFTER_S = 45.0   # from the group's close to the process's end, before the stacks are printed
_end_stacks_after_s: float | None = None


def watch_for_stalls() -> None:
    """A command-line job's two views of a rank that seems stuck, printed as every thread's Python
    stack (faulthandler): on `kill -USR1 <pid>` (the rank runs on), and by itself when the process has
    not ended END_STACKS_AFTER_S after its work was done and its group closed (a 1M run on 4 H200s sat
    minutes after its summary, 2026-11-28). Not in a host program or a test, whose process goes on."""
    global _end_stacks_after_s
    _end_stacks_after_s = END_STACKS_AFTER_S
    try:   # not where there is no SIGUSR1 (Windows) or stderr has no file descriptor (pytest's capsys)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):   # io.UnsupportedOperation is both of the last two
        pass


def _watch_the_end() -> None:
    if _end_stacks_after_s is None:
        return
    try:   # stderr without a file descriptor (captured) has nowhere to print them
        faulthandler.dump_traceback_later(_end_stacks_after_s, exit=False)
    except (ValueError, OSError, RuntimeError):
        pass


class PeerLost(RuntimeError):
    """A collective failed because another rank ended or stopped answering: an expected failure of a
    multi-process job (a killed or crashed peer), reported by this rank in one line."""


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def is_communication_failure(err: BaseException) -> bool:
    """Whether err is torch.distributed's (store, backend, network) or gloo's transport reporting a peer
    that closed its connection or did not answer in time (gloo raises a plain RuntimeError)."""
    return isinstance(err, dist.DistError) or "gloo/transport" in str(err)


# Long enough for a runnable thread to be scheduled on a loaded machine; paid once per job.
_SETTLE_S = 0.2


def _settle_collectives() -> None:
    """Let the backend's worker threads finish with the job's last collectives before the
    interpreter shuts down.

    A gloo worker drops a finished collective's tensors after the caller's wait() has returned, and
    dropping a tensor Python also knows needs the GIL. A worker still waiting for it when the
    interpreter finalizes is ended inside a noexcept frame and the process aborts ("terminate
    called without an active exception", exit -6) after a run that succeeded: 4 of 18 cp=2 CPU
    jobs did. The barrier ends every rank's collectives; the pause hands the GIL over.
    Only on success: after an error a peer may never reach the barrier.
    """
    if dist.get_world_size() > 1:
        dist.barrier()
    time.sleep(_SETTLE_S)  # releases the GIL


def _device_of_group(train_config) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return resolve_device(train_config.device) if dist.get_world_size() == 1 else torch.device("cpu")
