"""Step 2b for orchestrion, in JAX (jitted): SEG = tanh(PRE) * 0.5."""

import jax
import jax.numpy as jnp


def execute(PRE: jax.Array) -> dict[str, jax.Array]:
    """PRE: float32 [B, 16] -> SEG float32 [B, 16]."""
    return {"SEG": (jnp.tanh(PRE) * 0.5).astype(jnp.float32)}
