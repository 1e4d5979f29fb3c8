"""The suite's split by kind (tests/conftest.py): every collected test is exactly one of `unit` and
`integration`, so `pytest -m unit` and `pytest -m integration` together run what `pytest tests` runs,
once each; and the classifier sees a process started through a helper, a fixture or an import."""
import subprocess

import pytest

from tests.conftest import KINDS, _kind, _starts_process, _Walk
from tests.parallel.launcher import run_workers


def test_every_collected_test_is_unit_or_integration_and_not_both(request):
    items = request.session.items
    assert items
    wrong = {item.nodeid: kinds for item in items
             if len(kinds := [kind for kind in KINDS if item.get_closest_marker(kind)]) != 1}
    assert not wrong, wrong


def _echo():
    return subprocess.run(["true"], check=True)


def _through_a_helper():
    return _echo()


def _importing_inside():
    import torch.multiprocessing as mp
    return mp.get_context("spawn")


def _ranks():
    return run_workers(len, 2)


def _ranks_imported_inside():
    from tests.parallel.launcher import run_workers as spawn
    return spawn(len, 2)


class _Launches:
    def __call__(self):
        return _echo()


_launch = _Launches()


def _through_an_instance():
    return _launch()


def _asks_the_package_for_workers(main):
    return main(["in", "--out", "out", "--workers", "2"])


def _in_process():
    return sorted([3, 1, 2])


@pytest.mark.parametrize("function, starts", [(_echo, True), (_through_a_helper, True),
                                              (_importing_inside, True), (_ranks, True),
                                              (_ranks_imported_inside, True), (_through_an_instance, True),
                                              (_asks_the_package_for_workers, True),
                                              (lambda: _through_a_helper(), True), (_in_process, False)])
def test_a_function_that_starts_a_process_is_seen_through_the_names_it_reads(function, starts):
    assert _starts_process(function, _Walk()) is starts


@pytest.mark.integration
def test_a_marker_written_on_a_test_wins(request):
    """Marked by hand: the classifier alone would call this test unit (it starts no process)."""
    assert request.node.get_closest_marker("integration") and not request.node.get_closest_marker("unit")
    assert _kind(request.node) == "integration"
