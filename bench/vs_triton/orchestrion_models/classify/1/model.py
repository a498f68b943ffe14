"""Step 2a for orchestrion, in JAX (jitted): CLASS = softmax(PRE @ W + b).

W [16, 10] and b [10] are fixed: numpy's default_rng(0), as in Triton's copy.
"""

import jax
import jax.numpy as jnp
import numpy as np


def initialize(config: object) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 10)) * 0.25).astype(np.float32)
    b = (rng.standard_normal(10) * 0.1).astype(np.float32)
    return {"w": jnp.asarray(w), "b": jnp.asarray(b)}


def execute(params: dict[str, jax.Array], PRE: jax.Array) -> dict[str, jax.Array]:
    """PRE: float32 [B, 16] -> CLASS float32 [B, 10]."""
    logits = PRE @ params["w"] + params["b"]
    return {"CLASS": jax.nn.softmax(logits, axis=-1).astype(jnp.float32)}
