"""A rank waiting at start-up for peers that have not started says so (issue 44, item 4): a line after
a short delay and then every ~30 s, with how long it waited, the timeout and where, instead of nothing
for train.collective_timeout_s (600 s) before its error."""
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from gdn_parallel.runtime import waiting
from tests.runtime.test_session import free_port, launcher_environment

REPO = Path(__file__).resolve().parents[2]


def test_the_waiting_line_says_who_where_how_long_and_the_timeout():
    assert waiting.waiting_line(1, 4, "node0:29500", 30.4, 600) == (
        "wait  | rank 1 of 4: waited 30 s of train.collective_timeout_s=600 s for the other 3 ranks of the "
        "job at node0:29500; each of the 4 processes must start and reach node0:29500 (see the launcher's "
        "output on every node)")
    assert "for the other 1 rank of the job" in waiting.waiting_line(0, 2, "h:1", 10, 600)


def test_notices_come_after_the_first_delay_then_at_each_interval_and_stop_with_the_block():
    said, ticks = [], iter(range(0, 1000, 5))        # a clock that advances 5 s per reading
    spoken = threading.Semaphore(0)

    def say(line):
        said.append(line)
        spoken.release()

    with waiting.waiting_notices(lambda waited: f"waited {waited:.0f}", say=say, first_s=0.01, every_s=0.01,
                                 clock=lambda: next(ticks)):
        for _ in range(3):
            assert spoken.acquire(timeout=10)
    count = len(said)
    time.sleep(0.05)
    assert said[:3] == ["waited 5", "waited 10", "waited 15"] and len(said) == count   # none after


def test_a_join_that_ends_before_the_first_delay_says_nothing():
    said = []
    with waiting.waiting_notices(lambda waited: "waiting", say=said.append, first_s=5, every_s=5):
        pass
    assert said == []


LATE_PEER = '''
import sys
from gdn_parallel.config import TrainConfig
from gdn_parallel.runtime import waiting
from gdn_parallel.runtime.session import process_group

waiting.WAIT_NOTICE_FIRST_S = waiting.WAIT_NOTICE_EVERY_S = 0.5
with process_group(TrainConfig(device="cpu", collective_timeout_s=60)) as (device, launched):
    print("joined", flush=True)
'''


def test_a_rank_whose_peer_starts_late_says_it_is_waiting(tmp_path):
    """Two gloo processes through the launcher variables; rank 1 starts 3 s after rank 0, which says
    it waits for it, then both join."""
    script = tmp_path / "late_peer.py"
    script.write_text(LATE_PEER)
    port, ranks = str(free_port()), []
    for rank in (0, 1):
        env = launcher_environment(rank, 2, port)
        ranks.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        if rank == 0:
            time.sleep(3)
    try:
        outputs = [process.communicate(timeout=90)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [0, 0], outputs
    assert all("joined" in output for output in outputs), outputs
    assert re.search(rf"^wait  \| rank 0 of 2: waited \d+ s of train.collective_timeout_s=60 s for the other "
                     rf"1 rank of the job at 127.0.0.1:{port}; ", outputs[0], re.M), outputs[0]
