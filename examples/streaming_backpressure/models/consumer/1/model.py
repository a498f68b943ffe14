"""Reduces a chunk to (its index, a checksum) after some deliberate matrix work."""

import jax.numpy as jnp


def execute(CHUNK):
    work = CHUNK
    for _ in range(6):
        work = jnp.tanh(work @ CHUNK.T @ CHUNK / 1024.0)
    return {"SUMMARY": jnp.stack([CHUNK[0, 0], jnp.sum(work)])}
