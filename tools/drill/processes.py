"""Starting, watching and killing the trainer: the drill's workspace (temporary directories, tmpfs
mounts, child processes, all removed at exit), the commands it runs and how they ended."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.process_tree import descendants, kill_session, worker_pids  # noqa: F401  (the drill's names)

REPO = Path(__file__).resolve().parents[2]
# The tiny run: small enough that a process starts, trains and saves in seconds on 2 cores.
# A constant schedule: the corruption trials extend a 4-step run to 6 steps, which a schedule that reads
# train.steps refuses without train.schedule_override (issue 27).
TINY = ("model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.warmup_steps=1",
        "train.log_every=1", "train.eval_rows=2", "train.lr_schedule=constant")
RUN_LIMIT_S = 300        # any one command; a run past it counts as hung
# the drill's corpus: the first stdlib modules; a start takes ~7 s less than with all 31 MB
CORPUS_BYTES = 2_000_000


class Workspace:
    """The drill's temporary directory, the corpus it trains on, its tmpfs mounts and its child
    processes: `close` kills the children still running, unmounts and removes the directory."""

    def __init__(self, data: str, keep: bool):
        self.root = Path(tempfile.mkdtemp(prefix="fault_drill_"))
        self.keep = keep
        self.mounts: list[Path] = []
        self.children: list[subprocess.Popen] = []
        self.data_source = "stdlib" if data == "stdlib" else str(self._write_corpus())

    def _write_corpus(self) -> Path:
        """A copy of the first standard-library modules (sorted): text the trainer reads as a directory."""
        import sysconfig
        corpus = self.root / "corpus"
        corpus.mkdir()
        total = 0
        for module in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            shutil.copy(module, corpus / module.name)
            total += module.stat().st_size
            if total >= CORPUS_BYTES:
                break
        return corpus

    def directory(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}_", dir=self.root))

    def discard(self, path: Path) -> None:
        """A trial's directory, once its results are recorded (kept with --keep-temp)."""
        if not self.keep:
            shutil.rmtree(path, ignore_errors=True)

    def mount_tmpfs(self, path: Path, size_bytes: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True)
        self.mounts.append(path)

    @staticmethod
    def resize_tmpfs(path: Path, size_bytes: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(path)], check=True)

    def unmount(self, path: Path) -> None:
        if path not in self.mounts:
            return
        done = subprocess.run(["umount", str(path)], capture_output=True)
        if done.returncode != 0:  # a process still inside: detach now, freed when it ends
            subprocess.run(["umount", "-l", str(path)], check=False)
        self.mounts.remove(path)

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                kill_session(child)
        for path in list(self.mounts):
            self.unmount(path)
        if self.keep:
            print(f"kept {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def raise_on_signal(signum, frame):
    raise SystemExit(f"fault_drill: stopped by signal {signum}; cleaning up")


_WORKER_TAG = re.compile(r"^\[default(\d+)\]:")
_RANK_TAG = re.compile(r"^\[rank\d+\]: ?")


def attributed(text: str) -> Iterable[tuple[str, str]]:
    """(who, line): 'rank N' for a torchrun worker's tagged line, else 'launcher' (torchrun's agent,
    or the one process); without torchrun's `[defaultN]:` and torch's `[rankN]: ` tags."""
    for raw in text.splitlines():
        tag = _WORKER_TAG.match(raw)
        who, line = (f"rank {tag.group(1)}", raw[tag.end():]) if tag else ("launcher", raw)
        yield who, _RANK_TAG.sub("", line, count=1)


@dataclass
class Finished:
    """One command of a trial, as it ended."""
    argv: list[str]
    status: int | None        # None: still running at the limit (killed by the drill: a hang)
    stdout: str
    stderr: str
    wall_s: float
    torchrun: bool

    @property
    def hung(self) -> bool:
        return self.status is None

    def lines(self) -> list[str]:
        """stdout then stderr, each line without its rank tags."""
        return [line for _, line in attributed(self.stdout + "\n" + self.stderr)]

    def record(self) -> dict:
        """What the JSON keeps: the command, how it ended, and the end of its output (both streams)."""
        return {"command": shell_line(self.argv), "status": self.status, "wall_s": round(self.wall_s, 2),
                "hung": self.hung, "stderr_tail": self.stderr.strip().splitlines()[-3:],
                "output_tail": (self.stdout.strip().splitlines()[-12:] + ["--- stderr ---"]
                                + self.stderr.strip().splitlines()[-30:])}


def train_argv(workspace: Workspace, out_dir: Path, steps: int, overrides: Iterable[str] = (), procs: int = 1,
               resume: str | None = None, max_restarts: int | None = None) -> list[str]:
    """The trainer's command line: the tiny config under the drill's overrides, one process or torchrun."""
    settings = [*TINY, f"data.source={workspace.data_source}", f"train.out_dir={out_dir}", *overrides]
    if procs == 1:
        launcher = [sys.executable, "-m", "gdn_parallel.train"]
    else:   # torchrun as its console script runs it; --tee 3 tags each worker line with its rank
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--tee", "3",
                    *([f"--max-restarts={max_restarts}"] if max_restarts is not None else []),
                    "-m", "gdn_parallel.train"]
    argv = [*launcher, "--config", "configs/tiny-cpu.yaml", "--steps", str(steps)]
    for setting in settings:
        argv += ["--set", setting]
    return argv + (["--resume", resume] if resume else [])


def shell_line(argv: Sequence[str]) -> str:
    """A command as a user types it (torchrun / python3 for this interpreter)."""
    words = list(argv)
    if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    elif words[:1] == [sys.executable]:
        words = ["python3", *words[1:]]
    return " ".join(shlex.quote(word) for word in words)


def _child_env() -> dict[str, str]:
    # A drill started inside a launcher must not hand its rendezvous to the jobs it starts.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    return env


class Running:
    """A started command whose stdout and stderr go to files of the trial."""

    def __init__(self, workspace: Workspace, argv: list[str], log_stem: Path):
        self.argv, self.started = argv, time.monotonic()
        self.stdout_path, self.stderr_path = log_stem.with_suffix(".out"), log_stem.with_suffix(".err")
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.process = subprocess.Popen(argv, cwd=REPO, env=_child_env(), stdout=out, stderr=err,
                                            start_new_session=True)
        workspace.children.append(self.process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def finish(self, limit_s: float = RUN_LIMIT_S) -> Finished:
        """Wait for the end (at most limit_s from the start; then kill: a hang)."""
        remaining = max(0.0, limit_s - (time.monotonic() - self.started))
        try:
            status: int | None = self.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            kill_session(self.process)
            status = None
        return Finished(self.argv, status, self.stdout_path.read_text(errors="replace"),
                        self.stderr_path.read_text(errors="replace"), time.monotonic() - self.started,
                        torchrun="torch.distributed.run" in self.argv)

    def wait_for(self, condition: Callable[[], bool], limit_s: float, poll_s: float = 0.001) -> float | None:
        """The time `condition` first held, or None when the process ended first or limit_s passed."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if condition():
                return time.monotonic()
            if self.process.poll() is not None:
                return None
            time.sleep(poll_s)
        return None


def run(workspace: Workspace, argv: list[str], log_stem: Path, limit_s: float = RUN_LIMIT_S) -> Finished:
    return Running(workspace, argv, log_stem).finish(limit_s)
