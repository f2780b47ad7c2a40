"""Compute kernels: numba loops and LLVM-IR intrinsics, and the numpy fronts that call them."""
