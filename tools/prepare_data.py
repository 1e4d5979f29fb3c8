"""Moved into the package as gdn_parallel/data/prepare.py, the console script `gdn-prepare-data`. This
file keeps `python3 tools/prepare_data.py corpus/ --out data/x` and `import tools.prepare_data` working."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout
import gdn_parallel.data.prepare as moved  # noqa: E402

if __name__ == "__main__":
    sys.exit(moved.main())
# `import tools.prepare_data` is the package's module: patching it patches the tool
sys.modules[__name__] = moved
