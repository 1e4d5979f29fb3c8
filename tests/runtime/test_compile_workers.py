"""runtime/compile_workers.py: torch.compile's worker pools stopped within a bound at a job's end, the
helper process killed when torch's own stop does not return (as torch waits: on the helper's exit)."""
import subprocess
import sys
import threading
import time

import pytest
from torch._inductor import async_compile

from gdn_parallel.runtime.compile_workers import stop_compile_workers, stop_compile_workers_and_say


class FakePool:
    """A pool whose helper is a real process; `shutdown` waits for it to end, as torch's does."""

    def __init__(self, helper: subprocess.Popen, obeys: bool):
        self.process, self.obeys = helper, obeys

    def shutdown(self):
        if self.obeys:
            self.process.terminate()
        self.process.wait(300)


@pytest.fixture
def pool_of(monkeypatch):
    def install(obeys: bool) -> FakePool:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        pool = FakePool(helper, obeys)
        monkeypatch.setattr(async_compile, "_pool_set", {pool})
        monkeypatch.setattr(async_compile, "shutdown_compile_workers",
                            lambda: [p.shutdown() for p in list(async_compile._pool_set)])
        return pool
    yield install


def test_a_helper_that_does_not_stop_is_killed_after_the_bound(pool_of):
    pool = pool_of(obeys=False)
    began = time.perf_counter()
    seconds, killed, stopped = stop_compile_workers(0.5)
    assert killed == 1 and stopped
    assert pool.process.poll() is not None, "the helper still runs"
    assert 0.5 <= seconds < 10 and time.perf_counter() - began < 10


def test_a_helper_that_stops_is_not_killed(pool_of):
    pool = pool_of(obeys=True)
    seconds, killed, stopped = stop_compile_workers(30.0)
    assert killed == 0 and stopped and pool.process.poll() is not None and seconds < 30


def test_the_kill_is_said_and_a_quick_stop_is_not(pool_of):
    lines = []
    pool_of(obeys=False)
    stop_compile_workers_and_say(lines.append, 0.2)
    assert len(lines) == 1 and "did not stop within 0.2 s" in lines[0] and "killed 1" in lines[0]
    pool_of(obeys=True)
    stop_compile_workers_and_say(lines.append, 30.0)
    assert len(lines) == 1


def test_nothing_compiled_nothing_to_stop(monkeypatch):
    monkeypatch.setattr(async_compile, "_pool_set", set())
    assert stop_compile_workers(1.0) == (0.0, 0, True)


def test_a_pool_without_a_helper_to_kill_is_left_to_torch_and_said(monkeypatch):
    release = threading.Event()

    class ThreadPool:   # a pool of another kind: no helper process
        def shutdown(self):
            release.wait(30)

    pool = ThreadPool()
    monkeypatch.setattr(async_compile, "_pool_set", {pool})
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", pool.shutdown)
    lines = []
    try:
        stop_compile_workers_and_say(lines.append, 0.2)
    finally:
        release.set()
    assert len(lines) == 1 and "did not stop within 0.2 s" in lines[0] and "at exit" in lines[0]
