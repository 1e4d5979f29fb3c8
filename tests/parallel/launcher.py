"""Run a function on N gloo processes (torch.multiprocessing spawn) and collect results or errors."""
from __future__ import annotations

import faulthandler
import os
import queue
import socket
import traceback

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
