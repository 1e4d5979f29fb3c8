"""The compile watch names what a progress interval compiled (Triton kernels through Triton's own
compile hook, torch.compile graphs through dynamo's counter), and the logger records it and says it
once start-up is over: a slow step with a compilation in it explains itself."""
import pytest
import torch

from gdn_parallel.train import compile_watch
from gdn_parallel.train.compile_watch import CompileWatch, describe
from gdn_parallel.train.progress import ProgressLogger, ProgressSettings

triton = pytest.importorskip("triton")


def test_triton_and_graph_compilations_are_counted_per_interval(monkeypatch):
    from triton import knobs

    graphs = {"n": 3}
    monkeypatch.setattr(compile_watch, "_graphs_compiled", lambda: graphs["n"])
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: earlier.append(kw["fn"].name))
    watch = CompileWatch()
    try:
        assert watch.take() == {}
        hook = knobs.runtime.jit_post_compile_hook
        fn = type("Info", (), {"name": "ut_forward"})()
        hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
        hook(key=None, repr="", fn=fn, compile={}, is_manual_warmup=False, already_compiled=False)
        graphs["n"] = 4
        events = watch.take()
        assert events == {"triton": {"ut_forward": 2}, "graphs": 1}
        assert earlier == ["ut_forward", "ut_forward"]      # the hook found in place still runs
        assert describe(events) == "2 Triton kernel compilations (ut_forward 2) and 1 torch.compile graph"
        assert watch.take() == {}
    finally:
        watch.close()
    assert knobs.runtime.jit_post_compile_hook is not hook   # put back


def test_logger_records_and_says_a_compilation_after_start_up():
    printed, at = [], {"step": 0}
    compiled_at = {1: {"triton": {"state_forward": 1}}, 5: {"triton": {"state_forward": 1}}}
    logger = ProgressLogger(ProgressSettings(8, 1, 64), torch.device("cpu"), printed.append)
    logger.extras = lambda: {"compiled": compiled_at[at["step"]]} if at["step"] in compiled_at else {}
    for step in range(8):
        at["step"] = step
        logger.step(step, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert [r.get("compiled") for r in logger.records] == [compiled_at.get(step) for step in range(8)]
    notes = [line for line in printed if line.startswith("note")]
    assert notes == ["note  | step 5: 1 Triton kernel compilations (state_forward 1) since the last line "
                     "(seconds of this interval)"]   # step 1's is start-up's, said by the startup line


def test_another_rank_says_its_own_compilation(capsys):
    """Rank 0 prints the progress lines; a compilation on another rank (its shard's documents asked for
    a new kernel variant, and every rank waited) is printed by that rank, named."""
    printed = []
    logger = ProgressLogger(ProgressSettings(6, 1, 64), torch.device("cpu"), printed.append)
    logger.rank = 3
    conv = {"compiled": {"triton": {"_conv_fwd_kernel": 1}}}
    logger.extras = lambda: conv if len(logger.records) == 4 else {}
    for step in range(6):
        logger.step(step, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert not [line for line in printed if line.startswith("note")]
    assert capsys.readouterr().out.splitlines() == [
        "note  | rank 3, step 4: 1 Triton kernel compilations (_conv_fwd_kernel 1) since the last line "
        "(seconds of this interval)"]


def test_a_kernel_compiled_again_says_which_argument_changed(monkeypatch):
    """Triton's hook gives constexprs and specializations keyed by argument index: the watch names the
    argument whose variant changed (here a pointer that lost its 16-byte alignment, and a flag)."""
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    jit = type("Jit", (), {"arg_names": ["k", "doc_count", "Tp", "HAS_H0"]})()
    fn = type("Info", (), {"name": "state_forward", "jit_function": jit})()

    def compiled(aligned: bool, has_h0: bool) -> dict:
        attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
        if aligned:
            attrs[(1,)] = [["tt.divisibility", 16]]
        return {"signature": {"k": "*bf16", "doc_count": "*i32", "Tp": "i32", "HAS_H0": "constexpr"},
                "constants": {(3,): has_h0}, "configs": [attrs]}

    watch = CompileWatch()
    try:
        hook = knobs.runtime.jit_post_compile_hook
        for aligned, has_h0 in ((True, False), (True, False), (False, True)):
            hook(key=None, repr="", fn=fn, compile=compiled(aligned, has_h0), is_manual_warmup=False,
                 already_compiled=False)
        events = watch.take()
        why = events["recompiled"]["state_forward"]
        assert why == "HAS_H0 False -> True; doc_count specialization [['tt.divisibility', 16]] -> none"
        assert "state_forward again for HAS_H0 False -> True" in describe(events)
        assert "recompiled" not in watch.take()     # said once, for the interval it happened in
    finally:
        watch.close()
