"""Image segmentation: a small fully convolutional network giving a per-pixel map, in JAX.

conv 3->8 (3x3, same padding) + ReLU, conv 8->3 (1x1) + sigmoid. The output has the input's
spatial size, [B, 3, 224, 224], with each value in [0, 1] (a per-pixel score per channel).

The weights are NOT trained: they are random (He initialisation) from the fixed seed
``jax.random.PRNGKey(1)``, so the output is deterministic but segments nothing meaningful.
The model exists to show the shape and the cost profile of an ensemble step.
"""

import jax
import jax.numpy as jnp

_DIMENSION_NUMBERS = ("NCHW", "OIHW", "NCHW")


def _he(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(key, shape, dtype=jnp.float32) * jnp.sqrt(2.0 / fan_in)


def initialize(config: object) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(1), 2)
    return {
        "conv1_w": _he(k1, (8, 3, 3, 3), 3 * 3 * 3),
        "conv1_b": jnp.zeros((8,), jnp.float32),
        "conv2_w": _he(k2, (3, 8, 1, 1), 8),
        "conv2_b": jnp.zeros((3,), jnp.float32),
    }


def _conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DIMENSION_NUMBERS)
    return y + b[None, :, None, None]


def execute(params: dict[str, jax.Array], FORMATTED_IMAGE: jax.Array) -> dict[str, jax.Array]:
    """FORMATTED_IMAGE: float32 [B, 3, 224, 224] -> SEGMENTATION_OUTPUT float32 [B, 3, 224, 224]."""
    x = jnp.asarray(FORMATTED_IMAGE, jnp.float32)
    x = jax.nn.relu(_conv(x, params["conv1_w"], params["conv1_b"]))
    x = jax.nn.sigmoid(_conv(x, params["conv2_w"], params["conv2_b"]))
    return {"SEGMENTATION_OUTPUT": x.astype(jnp.float32)}
