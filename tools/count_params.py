"""Print the parameter count of model configs (built on the meta device: no memory, no init cost).

    python tools/count_params.py configs/*.yaml
"""
from __future__ import annotations

import argparse
import sys

import torch

from gdn_parallel.config import Config
from gdn_parallel.model import HybridLM


def count_parameters(config_path: str) -> dict:
    config = Config.from_yaml(config_path)
    with torch.device("meta"):
        model = HybridLM(config.model)
    return {
        "config": config_path,
        "layers": config.model.layer_types,
        "total": model.num_parameters(),
        "non_embedding": model.num_parameters(exclude_embeddings=True),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="YAML config files")
    args = parser.parse_args(argv)
    print(f"{'config':<28} {'total':>14} {'non-embedding':>14}  layers")
    for path in args.configs:
        row = count_parameters(path)
        print(f"{row['config']:<28} {row['total'] / 1e6:>12.1f} M {row['non_embedding'] / 1e6:>12.1f} M"
              f"  {row['layers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
