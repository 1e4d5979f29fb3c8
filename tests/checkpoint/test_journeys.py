"""User journeys across layouts, each hop compared with the uninterrupted run (CPU, gloo, fp32).

One prepared dataset (tools/prepare_data.py, bytes) and one uninterrupted single-process reference
run of REFERENCE_STEPS steps (global batch 2 x 64 tokens, a checkpoint every 3 steps) serve every
journey. After every hop, the training losses of the steps that hop ran are compared with the
reference's: to 1e-6 relative when the layout changed (other reduction orders), and bit for bit
(losses, gradient norms, validation losses, the next checkpoint's tensors) when a hop resumes under
the layout that saved, against the uninterrupted run of that layout.

The learning rate is warmup_steps=2 then constant (train.lr_schedule=constant): the schedule does not
read train.steps, so a hop can end after any step with `--steps N` and still follow the reference's
schedule (and its resumes are no schedule change); a resume that lost its step would redo the
half-rate warmup step and show in the losses.

Journeys (hops that start from the reference's step_3 get a copy of it; runs are shared through
module fixtures, so each multi-process hop is launched once):
  1. prepare data -> tp=2 -> SIGTERM to torchrun mid-run -> resume on one process -> to-hf -> from-hf
     (model tensors bit for bit) -> train the from-hf checkpoint under cp=2 vs one process
  2. (step_3 ->) pp=2 -> tp=2 -> one process, in one out_dir with --resume auto
  3. reshard step_3 to pp=2 --out DIR -> train from DIR/config.yaml under pp=2; the config.yaml that
     reshard --out writes, trained as written (pp=2, dp=2)
  4. DDP dp=2 evaluating before a checkpoint -> resume under DDP (bit for bit) and under FSDP dp=2
  5. (step_3 ->) FSDP dp=2 evaluating before a checkpoint -> resume under FSDP (bit for bit)
  6. step_3 resumed under cp=2, tp=2, dp=2 (5's first hop), pp=2 (2's first hop)
and SIGTERM delivered the other ways a job gets it (torchrun's process group, every process of the
job as Slurm signals a job step, the workers only), each checkpoint resumed on one process.

What SIGTERM does under torchrun (measured with torch 2.13 and 2.11): torchrun starts its workers in
sessions of their own (start_new_session), so a signal to torchrun's process group reaches torchrun
alone; torchrun forwards SIGTERM to the workers, waits for them (30 s, then SIGKILL) and exits 1 with
a SignalException traceback, while the workers finish the step, save, and exit 0. Only when the
workers alone are signalled does torchrun exit 0. The workers' own exit statuses are recorded by
WORKER, which runs `python -m gdn_parallel.train` (runpy, as __main__) in the worker process.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gdn_parallel.checkpoint import latest_checkpoint
from gdn_parallel.checkpoint.files import CONFIG_COPY, TRAINER_STATE
from gdn_parallel.config import Config
from gdn_parallel.convert.__main__ import main as gdn_convert
from gdn_parallel.train.__main__ import build_parser, load_config
from gdn_parallel.train.__main__ import run as gdn_train

REPO = Path(__file__).resolve().parents[2]
REFERENCE_STEPS = 12
CHECKPOINT_EVERY = 3
RTOL = 1e-6
COMMON = ["model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.log_every=1",
          "train.eval_rows=2", "train.warmup_steps=2", "train.lr_schedule=constant", "train.dtype=float32",
          "train.device=cpu"]
DP2 = ["parallel.dp=2", "train.batch_size=1"]                  # the same global batch of 2 rows
PP2 = ["parallel.pp=2", "train.microbatch_size=1"]             # 2 micro-batches for 2 stages
LAYOUTS = {"cp2": ["parallel.cp=2"], "tp2": ["parallel.tp=2"], "dp2": DP2, "pp2": PP2}
LAUNCH_TIMEOUT_S = 300

# Runs in each worker: `python -m gdn_parallel.train` as __main__, recording its pid and its exit status.
WORKER = r'''
import os, runpy
from pathlib import Path
where, rank = Path(os.environ["JOURNEY_STATUS_DIR"]), os.environ["RANK"]
(where / f"pid_rank{rank}").write_text(str(os.getpid()))
status = "exception"
try:
    runpy.run_module("gdn_parallel.train", run_name="__main__", alter_sys=True)
    status = 0
except SystemExit as stop:
    status = 0 if stop.code is None else stop.code
    raise
finally:
    (where / f"exit_rank{rank}").write_text(str(status))
'''
# torchrun's exit status for each way SIGTERM reaches the job (the workers exit 0 in all of them).
TORCHRUN_STATUS = {"torchrun": 1, "process_group": 1, "every_process": 1, "workers": 0}


# ------------------------------------------------------------------------------------------ helpers
def sets(*overrides: str) -> list:
    return [item for override in overrides for item in ("--set", override)]


def train_args(data: Path, out_dir: Path, steps: int, *overrides: str, resume: str = None) -> list:
    """gdn-train arguments of one hop: the common tiny settings, the data, then the hop's overrides."""
    argv = ["--steps", str(steps),
            *sets(*COMMON, f"data.source={data}", f"train.out_dir={out_dir}", *overrides)]
    return argv + (["--resume", resume] if resume else [])


def job_env(**extra: str) -> dict:
    # CPU and gloo on any machine (a multi-process job would take CUDA where it exists)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="", **extra)


def torchrun(nproc: int, *argv: str, module: str = "gdn_parallel.train") -> str:
    """Run a job of nproc processes to its end; returns its output (it must exit 0)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *argv]
    out = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S)
    output = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd)}\nexit {out.returncode}\n{output[-4000:]}"
    return output


def signalled_torchrun(nproc: int, argv: list, deliver: str, status_dir: Path) -> tuple:
    """Start a job of nproc processes, send SIGTERM once step 1 is logged, the way `deliver` says; wait for
    the end. Returns (torchrun's exit status, output, {rank: the worker's exit status as written})."""
    status_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--no-python", sys.executable, "-c", WORKER, *argv]
    env = job_env(JOURNEY_STATUS_DIR=str(status_dir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # a process group of its own, not pytest's
    workers = []

    def kill_job():  # the watchdog: only the processes of this job, by id
        for pid in (proc.pid, *workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    watchdog = threading.Timer(LAUNCH_TIMEOUT_S, kill_job)
    watchdog.start()
    lines, sent = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if not sent and line.startswith("step 1/"):
                workers.extend(int((status_dir / f"pid_rank{rank}").read_text()) for rank in range(nproc))
                if deliver == "torchrun":            # kill <torchrun pid>
                    os.kill(proc.pid, signal.SIGTERM)
                elif deliver == "process_group":     # kill -TERM -<pgid>: torchrun's group
                    os.killpg(proc.pid, signal.SIGTERM)
                elif deliver == "every_process":     # what Slurm does to a job step: every process of it
                    for pid in (proc.pid, *workers):
                        os.kill(pid, signal.SIGTERM)
                elif deliver == "workers":
                    for pid in workers:
                        os.kill(pid, signal.SIGTERM)
                else:
                    raise ValueError(deliver)
                sent = True
        status = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            kill_job()
    output = "".join(lines)
    assert sent, f"the job never logged step 1:\n{output[-4000:]}"
    exits = {}
    for rank in range(nproc):
        written = status_dir / f"exit_rank{rank}"
        exits[rank] = written.read_text() if written.is_file() else "killed (no status written)"
    return status, output, exits


def records(out_dir: Path) -> list:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def hop_records(out_dir: Path) -> list:
    """The metrics records of the latest process that wrote to out_dir (after its `resumed` marker)."""
    found = records(out_dir)
    starts = [i for i, record in enumerate(found) if record.get("resumed")]
    return found[starts[-1] + 1:] if starts else found


def losses(found: list) -> dict:
    return {r["step"]: r["loss"] for r in found if "loss" in r and "summary" not in r}


def field(found: list, name: str) -> dict:
    return {r["step"]: r[name] for r in found if name in r and "summary" not in r}


def assert_close(got: dict, expected: dict, steps, what: str) -> None:
    """Another layout: the losses of `steps` within RTOL (relative) of the reference's."""
    assert sorted(got) == list(steps), f"{what}: logged steps {sorted(got)}, expected {list(steps)}"
    for step in steps:
        assert abs(got[step] - expected[step]) <= RTOL * abs(expected[step]), \
            f"{what}: step {step} loss {got[step]!r}, reference {expected[step]!r}"


def assert_identical(got: list, expected: list, steps, what: str) -> None:
    """The same layout: the losses and gradient norms of `steps` bit for bit (and any validation loss)."""
    for name in ("loss", "grad_norm", "val_loss"):
        mine = field(got, name)
        theirs = {step: value for step, value in field(expected, name).items() if step in mine}
        if name != "val_loss":
            assert sorted(mine) == list(steps), f"{what}: logged steps {sorted(mine)}, expected {list(steps)}"
        assert mine == theirs, f"{what}: {name} differs: {mine} vs {theirs}"


def checkpoint_tensors(path: Path, scratch: Path) -> dict:
    """Every tensor of a checkpoint by its key, read with torch's own converter (any layout wrote it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return torch.load(target, weights_only=False)


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:8]}"
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{what}: {key} differs"


def trainer_state(path: Path) -> dict:
    return json.loads((path / TRAINER_STATE).read_text())


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def start_from(checkpoint: Path, run_dir: Path) -> Path:
    """A new run directory holding a copy of `checkpoint` (as if that run had been interrupted after it)."""
    shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)
    return run_dir


# ------------------------------------------------------------------------------------------ shared runs
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A tiny corpus written here, prepared by tools/prepare_data.py (byte tokenizer)."""
    import random

    import tools.prepare_data as prepare_data
    root = tmp_path_factory.mktemp("data")
    words = ("the state of a gated delta rule is handed from chunk to chunk and from rank to rank while "
             "checkpoints keep every tensor under its single device name").split()
    rng = random.Random(0)
    (root / "corpus").mkdir()
    for i in range(120):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 200)))
        (root / "corpus" / f"doc{i:03d}.txt").write_text(f"document {i}: {text}.\n")
    out = root / "tokens"
    assert prepare_data.main([str(root / "corpus"), "--out", str(out), "--tokenizer", "bytes",
                              "--progress", "off"]) == 0
    metadata = json.loads((out / "gdn_tokens.json").read_text())
    assert metadata["num_documents"] == 120 and metadata["tokenizer"]["kind"] == "bytes"
    return out


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict:
    """The uninterrupted single-process run: losses of steps 0..REFERENCE_STEPS-1, a checkpoint every 3."""
    out = tmp_path_factory.mktemp("reference")
    summary = gdn_train(train_args(data, out, REFERENCE_STEPS, f"checkpoint.interval={CHECKPOINT_EVERY}"))
    assert summary["start_step"] == 0 and summary["steps"] == REFERENCE_STEPS
    found = losses(records(out))
    assert sorted(found) == list(range(REFERENCE_STEPS))
    assert found[REFERENCE_STEPS - 1] < found[0] - 1.0  # it learns: a stale or reset state would show
    return {"dir": out, "losses": found, "step_3": out / "checkpoints" / "step_3"}


# ------------------------------------------------------------------------------------------ journeys
def test_journey_1_prepare_tp2_sigterm_one_process_to_hf_from_hf_cp2(data, reference, tmp_path):
    """Prepared data trained under tp=2 until SIGTERM to torchrun, resumed on one process, exported to a
    Hugging Face folder and converted back (a step-0 checkpoint: the weights bit for bit, a fresh AdamW),
    which trains alike on one process and under cp=2."""
    expected = reference["losses"]
    run_dir = tmp_path / "run"
    # tp=2, SIGTERM to torchrun mid-training: the step finishes, a checkpoint is written, the workers end
    status, output, exits = signalled_torchrun(2, train_args(data, run_dir, 400, "parallel.tp=2"), "torchrun",
                                               tmp_path / "status")
    assert exits == {0: "0", 1: "0"}, (exits, output[-4000:])
    assert status == TORCHRUN_STATUS["torchrun"], (status, output[-4000:])
    assert "stop  | a stop was asked for: ended after step" in output and "save  |" in output, output[-4000:]
    saved = latest_checkpoint(str(run_dir))
    stopped = step_of(saved)
    assert 2 <= stopped <= REFERENCE_STEPS - 3, f"stopped after {stopped} steps"
    state = trainer_state(saved)
    assert state["step"] == stopped and state["layout"]["tp"] == 2 and state["layout"]["world_size"] == 2
    assert_close(losses(hop_records(run_dir)), expected, range(stopped), "tp=2 until SIGTERM")

    # resume on one process, in the same out_dir
    end = stopped + 3
    summary = gdn_train(train_args(data, run_dir, end, resume="auto"))
    assert summary["start_step"] == stopped
    assert_close(losses(hop_records(run_dir)), expected, range(stopped, end), "one process after tp=2")

    # to-hf of the run (its newest checkpoint, fp32 as trained), from-hf back into a step-0 checkpoint
    hf, converted = tmp_path / "hf", tmp_path / "from_hf"
    assert gdn_convert(["to-hf", str(run_dir), str(hf)]) == 0
    assert json.loads((hf / "config.json").read_text())["model_type"] == "gated_deltanet"
    assert gdn_convert(["from-hf", str(hf), str(converted), "--config", str(run_dir / CONFIG_COPY)]) == 0
    newest = latest_checkpoint(str(run_dir))
    assert step_of(newest) == end
    trained = checkpoint_tensors(newest, tmp_path / "scratch")
    back = checkpoint_tensors(converted, tmp_path / "scratch")
    model_keys = sorted(k for k in trained if k.startswith("model."))
    assert model_keys and sorted(k for k in back if k.startswith("model.")) == model_keys
    assert_same_tensors({k: trained[k] for k in model_keys}, {k: back[k] for k in model_keys},
                        "to-hf/from-hf")
    assert all(trained[k].dtype == torch.float32 for k in model_keys)
    # a fresh AdamW at step 0: zero moments, step 0, the data stream at its start
    assert trainer_state(converted)["step"] == 0
    slots = {k: v for k, v in back.items() if k.startswith("optim.")}
    assert len(slots) == 3 * len(model_keys) and all(not v.any() for v in slots.values())

    # the from-hf checkpoint trained on one process and under cp=2: the same losses
    config = str(converted / CONFIG_COPY)
    single = gdn_train(["--config", config, *sets(f"train.out_dir={tmp_path / 'one'}"), "--steps", "3",
                        "--resume", str(converted)])
    assert single["start_step"] == 0
    one = losses(hop_records(tmp_path / "one"))
    assert one[0] < expected[0] - 0.5, (one, expected[0])  # the trained weights came along (fresh: ref[0])
    output = torchrun(2, "--config", config, *sets(f"train.out_dir={tmp_path / 'cp2'}", "parallel.cp=2"),
                      "--steps", "3", "--resume", str(converted))
    assert f"resume | {converted} | step 0" in output, output[-3000:]
    assert_close(losses(hop_records(tmp_path / "cp2")), one, range(3), "cp=2 from the from-hf checkpoint")


@pytest.mark.parametrize("deliver, layout",
                         [("process_group", "dp2"), ("every_process", "pp2"), ("workers", "cp2")])
def test_sigterm_under_torchrun_saves_a_resumable_checkpoint(data, reference, tmp_path, deliver, layout):
    """However SIGTERM reaches a torchrun job, the workers finish the step, save, and exit 0; torchrun's
    own status is TORCHRUN_STATUS[deliver]. The checkpoint resumes on one process."""
    expected = reference["losses"]
    run_dir = tmp_path / "run"
    status, output, exits = signalled_torchrun(2, train_args(data, run_dir, 400, *LAYOUTS[layout]), deliver,
                                               tmp_path / "status")
    assert exits == {0: "0", 1: "0"}, (exits, output[-4000:])
    assert status == TORCHRUN_STATUS[deliver], (status, output[-4000:])
    assert "stop  | a stop was asked for" in output and "save  |" in output, output[-4000:]
    saved = latest_checkpoint(str(run_dir))
    stopped = step_of(saved)
    assert 2 <= stopped <= REFERENCE_STEPS - 2, f"stopped after {stopped} steps"
    assert trainer_state(saved)["layout"]["world_size"] == 2
    assert_close(losses(hop_records(run_dir)), expected, range(stopped), f"{layout} until SIGTERM")
    summary = gdn_train(train_args(data, run_dir, stopped + 2, resume="auto"))
    assert summary["start_step"] == stopped
    assert_close(losses(hop_records(run_dir)), expected, range(stopped, stopped + 2),
                 f"one process after {layout}")


@pytest.fixture(scope="module")
def pp2_from_one_process(data, reference, tmp_path_factory) -> tuple:
    """The one-process step_3 resumed under pp=2 until step 6 (journey 6's pp=2 hop, journey 2's first):
    (run directory, output). Tests that go on from it copy the directory."""
    run_dir = start_from(reference["step_3"], tmp_path_factory.mktemp("pp2") / "run")
    output = torchrun(2, *train_args(data, run_dir, 6, *PP2, resume="auto"))
    return run_dir, output


def test_journey_2_pp2_then_tp2_then_one_process(data, reference, pp2_from_one_process, tmp_path):
    """Three hops in one out_dir, each resuming the previous one's newest checkpoint with --resume auto."""
    expected, run_dir = reference["losses"], tmp_path / "run"
    shutil.copytree(pp2_from_one_process[0], run_dir)  # pp=2 ran steps 3..5 here (journey 6 checks them)
    output = torchrun(2, *train_args(data, run_dir, 9, "parallel.tp=2", resume="auto"))
    assert f"resume | {run_dir / 'checkpoints' / 'step_6'} | step 6 | saved under" in output, output[-3000:]
    assert_close(losses(hop_records(run_dir)), expected, range(6, 9), "tp=2 after pp=2")
    summary = gdn_train(train_args(data, run_dir, 12, resume="auto"))
    assert summary["start_step"] == 9
    assert_close(losses(hop_records(run_dir)), expected, range(9, 12), "one process after tp=2")
    layouts = {step: trainer_state(run_dir / "checkpoints" / f"step_{step}")["layout"] for step in (6, 9, 12)}
    assert (layouts[6]["pp"], layouts[9]["tp"], layouts[12]["world_size"]) == (2, 2, 1), layouts
    assert sorted(losses(records(run_dir))) == list(range(3, 12))


@pytest.fixture(scope="module")
def reshard_out(reference, tmp_path_factory):
    """`gdn-convert reshard <run> --layout L --out DIR` (2 processes) of a run holding the one-process
    step_3, once per layout: returns DIR; DIR.parent/config_as_written.yaml keeps the config.yaml it wrote
    (training in DIR rewrites DIR/config.yaml with the trainer's resolved config)."""
    made = {}

    def reshard(layout: str) -> Path:
        if layout not in made:
            root = tmp_path_factory.mktemp("reshard")
            source = start_from(reference["step_3"], root / "source")
            out, report = root / "out", root / "report.json"
            # >= 2 stages
            micro_batches = ["--set", "train.microbatch_size=1"] if layout.startswith("pp") else []
            torchrun(2, "reshard", str(source), "--layout", layout, "--out", str(out), *micro_batches,
                     "--report", str(report), module="gdn_parallel.convert")
            found = json.loads(report.read_text())
            assert found["ok"] and found["step"] == 3 and found["held_by_no_rank"] == [], found
            assert found["saved_to"] == str(out / "checkpoints" / "step_3")
            shutil.copy(out / CONFIG_COPY, root / "config_as_written.yaml")
            made[layout] = out
        return made[layout]
    return reshard


def test_journey_3_reshard_to_pp2_then_train_under_pp2(reference, reshard_out, pp2_from_one_process):
    resharded = reshard_out("pp=2")
    checkpoint = resharded / "checkpoints" / "step_3"
    state = trainer_state(checkpoint)
    assert state["step"] == 3 and state["layout"]["pp"] == 2 and state["layout"]["world_size"] == 2
    written = Config.from_yaml(resharded.parent / "config_as_written.yaml", [], validate=False)
    assert written.train.out_dir == str(resharded) and written.parallel.pp == 2
    output = torchrun(2, "--config", str(resharded / CONFIG_COPY), "--resume", "auto", "--steps", "6")
    assert f"resume | {checkpoint} | step 3\n" in output, output[-3000:]  # under the layout that saved it
    assert_close(losses(hop_records(resharded)), reference["losses"], range(3, 6), "pp=2 after reshard")
    # the same state (every tensor landed, bit for bit) trained under the same layout: the pp=2 run that
    # resumed the one-process step_3 directly
    assert_identical(hop_records(resharded), hop_records(pp2_from_one_process[0]), range(3, 6),
                     "pp=2 from the resharded step_3 vs pp=2 from the one-process step_3")


@pytest.mark.parametrize("layout", ["pp=2", "dp=2"])
def test_reshard_out_config_continues_the_run(reference, reshard_out, layout):
    """The config.yaml that reshard --out writes is the run's, under the new layout, and gdn-train takes it
    as it is (`--config DIR/config.yaml --resume auto`): it must validate (a pipeline needs >= pp
    micro-batches: given with --set) and keep the run's global batch (train.batch_size is per
    data-parallel replica, rescaled by reshard)."""
    resharded = reshard_out(layout)
    written = resharded.parent / "config_as_written.yaml"
    source = Config.from_yaml(reference["dir"] / CONFIG_COPY, [], validate=False)
    config = load_config(build_parser().parse_args(["--config", str(written), "--resume", "auto"]))
    assert config.train.out_dir == str(resharded)
    assert config.parallel.dp * config.train.batch_size == source.parallel.dp * source.train.batch_size, (
        f"reshard --layout {layout} wrote train.batch_size={config.train.batch_size} per replica x "
        f"parallel.dp={config.parallel.dp}: a global batch of {config.parallel.dp * config.train.batch_size} "
        f"rows; the run it continues has {source.parallel.dp * source.train.batch_size}")


EVAL_AND_SAVE = ["train.eval_every=3", f"checkpoint.interval={CHECKPOINT_EVERY}"]  # evaluate, then save


def test_journey_4_ddp_with_evaluation_resumed_under_ddp_and_fsdp(data, reference, tmp_path):
    """DDP dp=2 evaluates, then saves step_3; resumed under DDP it is the uninterrupted DDP run bit for
    bit (losses, gradient norms, validation loss, step_6's tensors); under FSDP dp=2 it goes on to 1e-6."""
    expected = reference["losses"]
    ddp = [*DP2, "parallel.data_parallel=ddp", *EVAL_AND_SAVE]
    straight = tmp_path / "ddp"
    torchrun(2, *train_args(data, straight, 6, *ddp))
    assert_close(losses(records(straight)), expected, range(6), "ddp dp=2")
    assert sorted(field(records(straight), "val_loss")) == [2, 5]  # evaluated before each checkpoint
    checkpoint = straight / "checkpoints" / "step_3"

    again = start_from(checkpoint, tmp_path / "ddp_again")
    torchrun(2, *train_args(data, again, 6, *ddp, resume="auto"))
    assert_identical(hop_records(again), records(straight), range(3, 6), "ddp resumed under ddp")
    assert_same_tensors(checkpoint_tensors(straight / "checkpoints" / "step_6", tmp_path / "scratch"),
                        checkpoint_tensors(again / "checkpoints" / "step_6", tmp_path / "scratch"),
                        "ddp step_6, straight vs resumed")

    fsdp = start_from(checkpoint, tmp_path / "fsdp")
    torchrun(2, *train_args(data, fsdp, 6, *DP2, *EVAL_AND_SAVE, resume="auto"))
    assert_close(losses(hop_records(fsdp)), expected, range(3, 6), "fsdp dp=2 after ddp")


@pytest.fixture(scope="module")
def fsdp_from_one_process(data, reference, tmp_path_factory) -> tuple:
    """The one-process step_3 resumed under FSDP dp=2 until step 9, evaluating before each checkpoint
    (evaluations after steps 5 and 8, then step_6 and step_9): (run directory, output)."""
    run_dir = start_from(reference["step_3"], tmp_path_factory.mktemp("fsdp") / "run")
    output = torchrun(2, *train_args(data, run_dir, 9, *DP2, *EVAL_AND_SAVE, resume="auto"))
    return run_dir, output


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_journey_6_one_process_checkpoint_resumed_under(data, reference, tmp_path, layout, request):
    """One saved one-process checkpoint (the reference's step_3), four resumes under other layouts."""
    if layout == "dp2":  # the FSDP run journey 5 resumes
        (run_dir, output), end = request.getfixturevalue("fsdp_from_one_process"), 9
    elif layout == "pp2":  # the pipeline run journey 2 goes on from
        (run_dir, output), end = request.getfixturevalue("pp2_from_one_process"), 6
    else:
        run_dir, end = start_from(reference["step_3"], tmp_path / "run"), 6
        output = torchrun(2, *train_args(data, run_dir, end, *LAYOUTS[layout], resume="auto"))
    resumed = f"resume | {run_dir / 'checkpoints' / 'step_3'} | step 3 | saved under {{'world_size': 1"
    assert resumed in output, output[-3000:]
    assert_close(losses(hop_records(run_dir)), reference["losses"], range(3, end),
                 f"{layout} after one process")


def test_journey_5_fsdp_with_evaluation_before_the_checkpoint_resumes(data, reference, fsdp_from_one_process,
                                                                      tmp_path):
    """FSDP dp=2 saves after an evaluation, and the checkpoint resumes under FSDP dp=2 bit for bit. The
    save holds every optimizer slot (it used to miss those of the root module's parameters after an
    evaluation: "Missing key in checkpoint state_dict: optim.embeddings.weight.exp_avg")."""
    run_dir, _ = fsdp_from_one_process
    assert sorted(field(hop_records(run_dir), "val_loss")) == [5, 8]  # evaluated before step_6 and step_9
    checkpoint = run_dir / "checkpoints" / "step_6"
    saved = checkpoint_tensors(checkpoint, tmp_path / "scratch")
    names = [key[len("model."):] for key in saved if key.startswith("model.")]
    missing = [f"optim.{name}.{slot}" for name in names for slot in ("exp_avg", "exp_avg_sq", "step")
               if f"optim.{name}.{slot}" not in saved]
    assert names and not missing, missing

    again = start_from(checkpoint, tmp_path / "again")
    torchrun(2, *train_args(data, again, 9, *DP2, *EVAL_AND_SAVE, resume="auto"))
    assert_identical(hop_records(again), hop_records(run_dir), range(6, 9), "fsdp resumed under fsdp")
    assert_close(losses(hop_records(again)), reference["losses"], range(6, 9), "fsdp after fsdp")
    assert_same_tensors(checkpoint_tensors(run_dir / "checkpoints" / "step_9", tmp_path / "scratch"),
                        checkpoint_tensors(again / "checkpoints" / "step_9", tmp_path / "scratch"),
                        "fsdp step_9, straight vs resumed")
