"""What the kernels share: the cache-line-aligned buffers the SIMD tiles stream."""
import numpy as np
import pytest

from gemmalite.kernels.common import ALIGN, aligned_empty


@pytest.mark.parametrize("shape", [0, 1, 7, (3, 5), (128, 1536), (0, 9), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.float64])
def test_aligned_empty(shape, dtype):
    a = aligned_empty(shape, dtype)
    want = (shape,) if isinstance(shape, int) else shape
    assert a.shape == want and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % ALIGN == 0 or a.size == 0
    a[...] = 1  # the whole array is ours to write
    assert a.sum() == a.size
