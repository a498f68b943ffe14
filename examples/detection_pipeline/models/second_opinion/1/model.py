"""The second opinion: class probabilities of the whole image, from its 8x8 average-pooled
view, in JAX (untrained weights, from the fixed seed ``jax.random.PRNGKey(2)``)."""

import jax
import jax.numpy as jnp


def initialize(config: object) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(2), (64, 4), jnp.float32) * 0.5


def execute(weights: jax.Array, IMAGE: jax.Array) -> dict[str, jax.Array]:
    """IMAGE: float32 [64, 64] -> OPINION float32 [4]."""
    pooled = jnp.mean(jnp.reshape(jnp.asarray(IMAGE, jnp.float32), (8, 8, 8, 8)), axis=(1, 3))
    return {"OPINION": jax.nn.softmax(jnp.reshape(pooled, (64,)) @ weights)}
