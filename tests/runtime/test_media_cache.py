"""The soft-token cache shared by the vision and audio rooms: hits never re-encode, the least
recently used input goes first, and threads get one answer per digest."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gemmalite.runtime.media_cache import SoftTokenCache


def test_hits_do_not_encode_and_the_least_recent_goes():
    cache, calls = SoftTokenCache(2), []

    def enc(k):
        def run():
            calls.append(k)
            return np.full((2, 3), k, np.float32)
        return run

    a = cache.get(b"a", enc(1))
    assert cache.get(b"a", enc(99)) is a and calls == [1]  # a hit returns the kept rows
    cache.get(b"b", enc(2))
    cache.get(b"a", enc(99))  # a is now the most recent
    cache.get(b"c", enc(3))  # evicts b, not a
    assert calls == [1, 2, 3]
    assert cache.get(b"a", enc(99)) is a
    cache.get(b"b", enc(4))
    assert calls == [1, 2, 3, 4]


def test_threads_get_equal_rows():
    cache = SoftTokenCache(4)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: cache.get(bytes([i % 3]), lambda: np.arange(6.0, dtype=np.float32) * (i % 3)),
                            range(48)))
    for i, g in enumerate(got):
        assert np.array_equal(g, np.arange(6.0, dtype=np.float32) * (i % 3))
