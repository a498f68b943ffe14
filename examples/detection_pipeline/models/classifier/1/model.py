"""The classifier: a small dense network over a 16x16 crop, 4 classes, in JAX.

The weights are NOT trained: random from the fixed seed ``jax.random.PRNGKey(1)``, so the
probabilities are deterministic but mean nothing; the example shows the pipeline's shape.
"""

import jax
import jax.numpy as jnp

CLASSES = 4


def initialize(config: object) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {
        "hidden": jax.random.normal(k1, (256, 32), jnp.float32) * jnp.sqrt(2.0 / 256),
        "out": jax.random.normal(k2, (32, CLASSES), jnp.float32) * jnp.sqrt(2.0 / 32),
    }


def execute(params: dict[str, jax.Array], CROP: jax.Array) -> dict[str, jax.Array]:
    """CROP: float32 [B, 16, 16] -> PROBABILITIES float32 [B, 4]."""
    x = jnp.reshape(jnp.asarray(CROP, jnp.float32), (CROP.shape[0], -1))
    hidden = jax.nn.relu(x @ params["hidden"])
    return {"PROBABILITIES": jax.nn.softmax(hidden @ params["out"], axis=-1)}
