"""gdn-launch-scripts: where the launch scripts (torchrun.sh, deepspeed.sh, mpirun.sh, slurm.sbatch,
hostfile.example: the files of launch/) are, after `pip install` as in a source checkout, or copies of
them in a directory.

    gdn-launch-scripts                 # prints their directory: bash "$(gdn-launch-scripts)/torchrun.sh" ...
    gdn-launch-scripts --copy-to job/  # copies them (executable) into job/, e.g. to edit or to submit

`launch/` sits at the repository root and is installed as gdn_parallel/launch/ (setup.py).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path

PROG = "gdn-launch-scripts"
MARKER = "torchrun.sh"        # a directory holding it is the launch scripts' directory
EXECUTABLE_SUFFIXES = (".sh", ".sbatch")
REPO_LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def scripts_dir() -> Path:
    """The directory of the launch scripts: the copy installed with the package, else the source
    checkout's launch/ (an editable install runs from there)."""
    installed = Path(str(resources.files("gdn_parallel") / "launch"))  # a folder: wheels install unzipped
    for candidate in (installed, REPO_LAUNCH):
        if (candidate / MARKER).is_file():
            return candidate
    raise FileNotFoundError(f"the launch scripts are neither at {installed} nor at {REPO_LAUNCH}; "
                            f"reinstall gdn-parallel (pip install .)")


def copy_scripts(destination: Path, force: bool = False) -> list[Path]:
    """Copy every script into destination (created if missing), executable; an existing file there is
    replaced only with force."""
    names = sorted(path.name for path in scripts_dir().iterdir() if path.is_file())
    existing = [destination / name for name in names if (destination / name).exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(map(str, existing))} already exist(s); give --force to "
                              f"replace, or another directory")
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        target = destination / name
        shutil.copyfile(scripts_dir() / name, target)
        target.chmod(0o755 if name.endswith(EXECUTABLE_SUFFIXES) else 0o644)
        copied.append(target)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--copy-to", type=Path, metavar="DIR", help="copy the scripts into DIR")
    parser.add_argument("--force", action="store_true", help="with --copy-to: replace scripts already in DIR")
    args = parser.parse_args(argv)
    if args.force and args.copy_to is None:
        parser.error("--force goes with --copy-to DIR")
    try:
        if args.copy_to is None:
            print(scripts_dir())
            return 0
        copied = copy_scripts(args.copy_to, args.force)
    except OSError as err:  # missing scripts, files in the way, a directory that cannot be written
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"copied {', '.join(path.name for path in copied)} to {args.copy_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
