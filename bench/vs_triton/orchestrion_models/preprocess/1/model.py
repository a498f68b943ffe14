"""Step 1 for orchestrion, in JAX (jitted): PRE = INPUT * 2 + 1."""

import jax
import jax.numpy as jnp


def execute(INPUT: jax.Array) -> dict[str, jax.Array]:
    """INPUT: float32 [B, 16] -> PRE float32 [B, 16]."""
    return {"PRE": (INPUT * 2.0 + 1.0).astype(jnp.float32)}
