"""The constants the fp8 W8A8 layer (`core/models/fp8_linear.py`) and its kernels (`fp8_kernels.py`) share."""

from __future__ import annotations

import torch

# Smallest row amax of an activation: a row of zeros (padding) gets a finite scale and quantizes to zeros;
# small enough for any activation a 16-bit model makes, large enough that 448 / amax stays finite in fp32.
MIN_AMAX = 1e-30
# Largest row amax: an infinite activation saturates at +-448 instead of making inf / inf.
F32_MAX = float(torch.finfo(torch.float32).max)
# The smallest BLOCK_N of the GEMV's configs (`fp8_kernels.gemv_config`): sizes the split-K counters.
MIN_BLOCK_N = 32
