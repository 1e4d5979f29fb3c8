"""torch.compile's worker processes, stopped within a bound when a job's work is done.

Inductor compiles kernels in worker processes: a helper process per rank with up to 32 workers under
it, kept until the interpreter exits. At exit torch asks the helper to stop and waits up to 300 s for
it; torch's own tracker has a report of that wait running out after a cold start. So the command-line
jobs stop the workers themselves once their work is done: the same request torch makes, waited for
`limit_s`, then the helper is killed. Nothing is lost by the kill: compiled kernels are in the caches
on disk, and the workers end themselves once their parent is gone. The seconds are reported so that a
slow end shows where it went. (It was the first suspect for a 1M run on 4 H200s that sat minutes after
its summary, 2026-11-28; the stacks then showed the ranks in destroy_process_group, runtime/session.py,
with these workers stopped in 1.3 s.)
"""
from __future__ import annotations

import sys
import threading
import time

STOP_LIMIT_S = 10.0   # how long a job's end waits for the workers before it kills their helper


def stop_compile_workers(limit_s: float) -> tuple[float, int, bool]:
    """(seconds taken, helper processes killed, stopped): torch.compile's worker pools of this process
    stopped. (0.0, 0, True) when there are none (nothing was compiled, or this torch keeps no such
    pools). Not stopped: a pool of another kind (no helper process to kill) did not return in time;
    it is left to torch's own stop at exit."""
    async_compile = sys.modules.get("torch._inductor.async_compile")   # not imported: nothing compiled
    if async_compile is None:
        return 0.0, 0, True
    pools = list(getattr(async_compile, "_pool_set", ()))
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if not pools or shutdown is None:
        return 0.0, 0, True
    helpers = [pool.process for pool in pools if getattr(pool, "process", None) is not None]
    began = time.perf_counter()
    stopper = threading.Thread(target=shutdown, name="stop-compile-workers", daemon=True)
    stopper.start()
    stopper.join(limit_s)
    killed = 0
    if stopper.is_alive():
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
                killed += 1
        if killed:
            stopper.join(5.0)   # torch's wait for the helper returns once it is gone
    return time.perf_counter() - began, killed, not stopper.is_alive()


def stop_compile_workers_and_say(say, limit_s: float = STOP_LIMIT_S) -> None:
    """stop_compile_workers, with one line through `say` when it took a noticeable time or had to kill."""
    seconds, killed, stopped = stop_compile_workers(limit_s)
    if not stopped:
        say(f"end   | torch.compile's worker processes did not stop within {limit_s:g} s of being asked; "
            f"torch stops them at exit (up to 300 s)")
    elif killed:
        say(f"end   | torch.compile's worker processes did not stop within {limit_s:g} s of being asked: "
            f"killed {killed} (compiled kernels are cached on disk; nothing is lost)")
    elif seconds >= 1.0:
        say(f"end   | torch.compile's worker processes stopped in {seconds:.1f} s")
