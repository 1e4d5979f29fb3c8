"""Package metadata for gdn-parallel.

torch is pinned to a range, not a build: on CPU machines install `torch==2.13.0` in the same pip
call (see README) so pip does not fetch a multi-GB CUDA wheel; GPU images bring their own torch.
"""
from setuptools import find_packages, setup

setup(
    name="gdn-parallel",
    version="0.1.0",
    description="Distributed long-context pretraining of Gated DeltaNet / sliding-window-attention hybrids",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `kernels/` is installed as `gdn_kernels`: a top-level module named `kernels` would shadow
    # other libraries' modules of that name.
    packages=find_packages(include=["gdn_parallel", "gdn_parallel.*"]) + ["gdn_kernels"],
    package_dir={"gdn_kernels": "kernels"},
    package_data={"gdn_parallel": ["py.typed"]},
    install_requires=["torch>=2.11,<2.15", "PyYAML>=6", "numpy"],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "matplotlib", "triton>=3.4"],  # triton: interpreter tests on CPU
        "gpu": ["triton>=3.4"],
        "launch": ["deepspeed", "mpi4py"],
        "log": ["wandb", "tensorboard", "matplotlib"],
        "hf": ["safetensors", "tokenizers", "transformers"],
    },
    entry_points={
        "console_scripts": [
            "gdn-train=gdn_parallel.train.__main__:main",
        ]
    },
)
