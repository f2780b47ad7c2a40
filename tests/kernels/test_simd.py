"""`kernels.simd`'s integer tiles: the code a VNNI target gets (``vpdpwssd`` in several chains, no
software prefetch) gives the bits the AVX2 code gives (``vpmaddwd`` and adds, prefetch)."""
import subprocess
import sys

import numpy as np
from conftest import haswell_env

from gemmalite.kernels.simd import TILE_BLOCK

_SHAPES = [(37, 1536, 1, 1, 0), (33, 2 * TILE_BLOCK, 3, 1, 1), (64, 12288, 1, 4, 2), (9, TILE_BLOCK, 4, 4, 3),
           (50, 32 * 7, 2, 1, 4)]  # rows, width (the last: groups of 32), tokens, rows a task, seed

# run here and, as source, in a subprocess compiled for Haswell
_RUN = """
import numpy as np
from gemmalite.kernels.quant import i8_mvn_w8a16
from gemmalite.kernels.simd import TILE_BLOCK, int16_activation_rows


def run(n, k, t, rows, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (n, k), dtype=np.int8)
    q[0], q[-1] = 127, -127  # the largest block sums
    scale = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 20, (t, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero group
    xq, xd = int16_activation_rows(x, np.int64(TILE_BLOCK if k % TILE_BLOCK == 0 else 32))
    out = np.empty((t, n), np.float32)
    i8_mvn_w8a16(q, scale, xq, xd, rows, out)
    return out
"""
exec(_RUN, _here := {})


def test_int8_decode_tiles_same_bits_on_a_cpu_without_vnni(tmp_path):
    """The int8 decode kernel (`quant.i8_mvn_w8a16`: 1- and 4-row tiles, 1-4 tokens, per-256 and
    per-32 activation steps) compiled for this host and for Haswell in a subprocess: every output
    the same to the bit, since only the order of exact int32 additions differs. (On a host without
    VNNI both compile the same code; a VNNI host holds its chains against the AVX2 code.)"""
    code = _RUN + f"\nimport sys\nnp.savez(sys.argv[1], *[run(*s) for s in {_SHAPES!r}])\n"
    out = tmp_path / "haswell.npz"
    r = subprocess.run([sys.executable, "-c", code, str(out)], env=haswell_env(tmp_path), capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = np.load(out)
    for i, shape in enumerate(_SHAPES):
        np.testing.assert_array_equal(_here["run"](*shape), theirs[f"arr_{i}"], err_msg=str(shape))
