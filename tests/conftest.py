"""Test-wide setup: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

This must happen before anything imports triton, so it lives in the root conftest.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
