"""Soft tokens of the last media inputs seen, by digest: a chat turn re-sends every earlier
picture and clip, and re-encoding them would cost a tower pass each. One mechanism for the
vision and audio rooms."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from .threads import compute


class SoftTokenCache:
    """A small LRU of ``digest -> soft tokens [N, H]``, safe across threads. A miss encodes outside
    the lock (two threads may both encode a new input; both get equal rows) and inside the
    kernels' process-wide compute slot, so a server keeps decoding between tower passes."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def get(self, digest: bytes, encode: Callable[[], np.ndarray]) -> np.ndarray:
        with self._lock:
            soft = self._rows.get(digest)
            if soft is not None:
                self._rows.move_to_end(digest)
                return soft
        with compute(None):
            soft = encode()
        with self._lock:
            self._rows[digest] = soft
            while len(self._rows) > self.size:
                self._rows.popitem(last=False)
        return soft
