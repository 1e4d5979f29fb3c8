"""Package metadata for gdn-parallel.

torch is pinned to a range, not a build: on CPU machines install `torch==2.13.0` in the same pip
call (see README) so pip does not fetch a multi-GB CUDA wheel; GPU images bring their own torch.
"""
from setuptools import find_namespace_packages, setup

# Bounded to what is run: torch 2.11 + Triton 3.6 (GPU image), torch 2.13 + Triton 3.9 (CPU tests).
TORCH = "torch>=2.11,<2.15"
TRITON = "triton>=3.6,<3.10"
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]

setup(
    name="gdn-parallel",
    version="0.1.0",
    description="Distributed long-context pretraining of Gated DeltaNet / sliding-window-attention hybrids",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `kernels/` is installed as `gdn_kernels`: a top-level module named `kernels` would shadow
    # other libraries' modules of that name. Subpackages are found, not listed, so none goes missing;
    # namespace search because a folder without __init__.py (gdn_parallel/parallel/) is a package too.
    # `configs/` stays at the repository root (docs and users name `configs/...`) and is shipped as
    # `gdn_parallel/configs/` so that `gdn-train --config configs/NAME.yaml` works after `pip install .`.
    packages=(find_namespace_packages(include=["gdn_parallel", "gdn_parallel.*"], exclude=NOT_PACKAGES)
              + ["gdn_kernels"]
              + [f"gdn_kernels.{name}" for name in find_namespace_packages("kernels", exclude=NOT_PACKAGES)]
              + ["gdn_parallel.configs"]),
    package_dir={"gdn_kernels": "kernels", "gdn_parallel.configs": "configs"},
    package_data={"gdn_parallel": ["py.typed"], "gdn_parallel.configs": ["*.yaml"]},
    install_requires=[TORCH, "PyYAML>=6", "numpy"],
    extras_require={
        # triton: interpreter tests on CPU; setuptools: tests/test_packaging.py builds the wheel without
        # build isolation (70.1+ builds wheels without the separate `wheel` package)
        # tokenizers: the prepared-data tests with a real tokenizer
        # transformers + flash-linear-attention: tests/convert loads our exports into fla's model (the base
        # packages need only einops and transformers: no CUDA torch; fla-core's [cuda] extra is not asked for)
        "dev": ["pytest>=8", "pytest-timeout", "matplotlib", TRITON, "setuptools>=70.1", "tokenizers",
                "transformers>=5.6.2,<6", "flash-linear-attention==0.6.0", "fla-core==0.6.0"],
        "gpu": [TRITON],
        "log": ["matplotlib", "tensorboard"],  # loss.png, tools/plot.py; log.tensorboard (wandb: pip install wandb)
        "data": ["tokenizers", "pyarrow"],      # tools/prepare_data.py: --tokenizer FILE, Parquet inputs
        "launch": ["mpi4py"],                   # launch/mpirun.sh across nodes (the master address)
    },
    entry_points={
        "console_scripts": [
            "gdn-train=gdn_parallel.train.__main__:main",
            "gdn-convert=gdn_parallel.convert.__main__:main",
            "gdn-verify=gdn_parallel.verify.__main__:main",
        ]
    },
)
