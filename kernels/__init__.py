"""Triton kernels of gdn-parallel, installed as the package `gdn_kernels` (not `kernels`: other
libraries use that top-level name).

The GPU kernels (gated delta rule chunk forward/backward, the CP summary scan, fused conv, norms
and loss) land here with their own modules; `gdn_parallel.ops` dispatches to them when they import
and falls back to the PyTorch `chunk` path otherwise.
"""
