"""Moved into the package as gdn_parallel/evaluate/niah.py, the console script `gdn-eval-niah`. This file
keeps `python3 tools/eval_niah.py make-data|eval ...` and `import tools.eval_niah` working."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout
import gdn_parallel.evaluate.niah as moved  # noqa: E402

if __name__ == "__main__":
    sys.exit(moved.main())
sys.modules[__name__] = moved  # `import tools.eval_niah` is the package's module: patching it patches it
