"""Run a function on N gloo processes (torch.multiprocessing spawn) and collect results or errors."""
from __future__ import annotations

import faulthandler
import os
import queue
import socket
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, world_size: int, *args, timeout: float = None) -> list:
    """fn(rank, world_size, *args) on each rank; returns the list of results by rank.

    Any worker exception fails the caller with that worker's traceback; a hang fails at `timeout`.
    """
    timeout = timeout or float(os.environ.get("GDN_TEST_TIMEOUT_S", 300))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    collected, errors = {}, []
    try:
        for _ in range(world_size):
            rank, error, value = results.get(timeout=timeout)
            if error:
                errors.append(f"rank {rank}:\n{error}")
            collected[rank] = value
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for workers (deadlock?); got ranks "
                      f"{sorted(collected)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[r] for r in range(world_size)]


def _worker(fn, rank, world_size, port, results, args, hang_report_s=None):
    torch.set_num_threads(1)
    # A deadlocked worker prints where it is stuck before the parent gives up on it.
    faulthandler.dump_traceback_later(hang_report_s or float(os.environ.get("GDN_TEST_HANG_REPORT_S", 280)),
                                      exit=False)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, None, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, traceback.format_exc(), None))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            # Queue.put hands the result to a feeder thread: flush it before leaving, then leave
            # without running atexit handlers (gloo can abort at interpreter exit).
            results.close()
            results.join_thread()
            os._exit(0)


def _run_cases(rank: int, world_size: int, cases: list) -> list:
    return [fn(rank, world_size, *args) for fn, *args in cases]


class SharedLaunch:
    """Cases that need the same number of processes, run in one launch of them.

    Starting N processes (each importing torch and the package) costs seconds of CPU a process, more
    than most cases take. Each test module names its cases here; the first test of the session that
    needs N processes runs every case of N processes that the session's modules named and that has
    not run yet, one after another in the same group, and each test then reads its own result. Should
    any case of a shared launch fail (or hang), each of its cases runs in a launch of its own when its
    test asks, as without sharing, so a failure is reported by the test it belongs to, with that
    case's traceback, and never hidden by another case."""

    _instances: list[SharedLaunch] = []

    def __init__(self, cases: dict):
        """cases: {key: (world_size, fn, *args)}; fn(rank, world_size, *args) as for run_workers."""
        self.cases, self.results = cases, {}
        SharedLaunch._instances.append(self)

    def __call__(self, key) -> list:
        """The case's results by rank (what run_workers returns for it)."""
        world_size, fn, *args = self.cases[key]
        if world_size not in self.results:
            _launch_together(world_size)
        if key in self.results[world_size]:
            return self.results[world_size][key]
        return run_workers(fn, world_size, *args)


def _launch_together(world_size: int) -> None:
    waiting = [launch for launch in SharedLaunch._instances if world_size not in launch.results]
    jobs = [(launch, key) for launch in waiting
            for key, case in launch.cases.items() if case[0] == world_size]
    for launch in waiting:      # no result yet: a launch stopped on its way (a test's timeout) is not rerun
        launch.results[world_size] = {}
    try:
        # within pytest's 600 s a test; a hung case (a wrong collective) ends the launch here
        by_rank = run_workers(_run_cases, world_size, [launch.cases[key][1:] for launch, key in jobs],
                              timeout=min(300 + 5 * len(jobs), 500))
    except AssertionError as failure:
        warnings.warn(f"the shared launch of {world_size} processes failed; its cases run one launch "
                      f"each: {str(failure)[-2000:]}", stacklevel=3)
        return
    for i, (launch, key) in enumerate(jobs):
        launch.results[world_size][key] = [ranks[i] for ranks in by_rank]
