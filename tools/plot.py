"""Moved into the package as gdn_parallel/train/plot.py, the console script `gdn-plot`. This file keeps
`python3 tools/plot.py runs/a --out curves.png` and `import tools.plot` working."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout
import gdn_parallel.train.plot as moved  # noqa: E402

if __name__ == "__main__":
    sys.exit(moved.main())
sys.modules[__name__] = moved  # `import tools.plot` is the package's module: patching it patches the tool
