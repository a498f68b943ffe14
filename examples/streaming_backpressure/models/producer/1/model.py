"""Yields one 1 MiB chunk per response, as fast as it is asked for them."""

import numpy as np

JIT = False  # a generator: jax.jit cannot compile it


def execute(CHUNKS):
    rng = np.random.default_rng(int(CHUNKS[0]))
    for index in range(int(CHUNKS[0])):
        chunk = rng.standard_normal((256, 1024), dtype=np.float32)
        chunk[0, 0] = index
        yield {"CHUNK": chunk}
