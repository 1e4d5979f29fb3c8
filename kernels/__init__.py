"""Triton kernels of gdn-parallel, installed as the package `gdn_kernels` (not `kernels`: other
libraries use that top-level name).

A leaf: these modules import torch and triton only, never gdn_parallel. The GPU kernels (gated delta
rule chunk forward/backward and its CP summary scan, fused conv, norms, linear + cross-entropy) have
their own modules; `chunk_layout` and `host_index` are torch-only helpers that the PyTorch ops share.
`gdn_parallel.ops` dispatches to the kernels (ops/triton_dispatch.py) and falls back to its PyTorch
forms where they do not run.
"""
