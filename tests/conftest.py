"""Without a GPU, Triton kernels run in Triton's interpreter. The variable is read when a kernel is
decorated, so it is set here, before any test module imports gdn_kernels."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
