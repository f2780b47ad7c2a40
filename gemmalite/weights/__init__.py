"""Weight matrices by storage (float, int8, int4, GGML blocks), all behind the `Matrix` interface."""
