"""The processes a job started, found and stopped whole (Linux /proc).

torchrun starts each worker in a session of its own, so a signal to the agent's process group reaches
the agent alone: killed that way, its workers go on training and hold their GPUs through whatever runs
next (2026-11-28: a 1M run killed at its time limit kept its four ranks alive and stalled the two runs
after it). These functions find the workers below a child and stop them with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

GONE_WAIT_S = 10.0    # how long a kill waits for the killed processes to end
STACKS_WAIT_S = 3.0   # how long a stopped job's ranks get to print their stacks before they are killed


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL a child and everything it started. torchrun starts each worker in a session of its own
    (to kill it by group), so the workers are found first and killed with their groups too: killing
    the agent's group alone leaves them training."""
    doomed = [process.pid, *descendants(process.pid)]
    for pid in doomed:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):   # not a group leader, or gone: the process itself
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    process.wait()
    deadline = time.monotonic() + GONE_WAIT_S   # a GPU's memory is free only once its process has ended
    while any(running(pid) for pid in doomed) and time.monotonic() < deadline:
        time.sleep(0.1)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, parent pid, ...), or None when the
    process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an ended one not yet reaped by its parent is not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every live process (Linux /proc)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(entry.name)
        if fields is not None:   # else ended while we looked
            found[int(entry.name)] = int(fields[1])
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of a torchrun agent's worker processes (Linux /proc)."""
    workers = {}
    for pid, parent in _parents().items():
        if parent != agent_pid:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended while we looked
            continue
        rank = next((int(item[5:]) for item in environ if item.startswith(b"RANK=")), None)
        if rank is not None:
            workers[rank] = pid
    return workers


def stop_job(process: subprocess.Popen) -> None:
    """Kill a job that ran past its time: first SIGUSR1 to torchrun's workers (or to the process itself
    when it has none), on which the trainer and gdn-verify print every thread's stack (faulthandler)
    and run on, so the log shows where it was stuck; then SIGKILL to everything below it
    (kill_session)."""
    if process.poll() is not None:
        return
    asked = 0
    for pid in worker_pids(process.pid).values() or [process.pid]:
        try:
            os.kill(pid, signal.SIGUSR1)
            asked += 1
        except ProcessLookupError:
            pass
    if asked:
        time.sleep(STACKS_WAIT_S)
    kill_session(process)
