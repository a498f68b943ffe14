"""Image classification: a small convolutional network over 1000 classes, in JAX.

conv 3->16 (7x7, stride 4) + ReLU, conv 16->32 (3x3, stride 2) + ReLU, global average pool,
dense 32->1000, softmax. The output is a probability distribution over 1000 classes.

The weights are NOT trained: they are random (He initialisation) from the fixed seed
``jax.random.PRNGKey(0)``, so the output is deterministic but the "classes" mean nothing.
The model exists to show the shape and the cost profile of an ensemble step.
"""

import jax
import jax.numpy as jnp

NUM_CLASSES = 1000
_DIMENSION_NUMBERS = ("NCHW", "OIHW", "NCHW")


def _he(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(key, shape, dtype=jnp.float32) * jnp.sqrt(2.0 / fan_in)


def initialize(config: object) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "conv1_w": _he(k1, (16, 3, 7, 7), 3 * 7 * 7),
        "conv1_b": jnp.zeros((16,), jnp.float32),
        "conv2_w": _he(k2, (32, 16, 3, 3), 16 * 3 * 3),
        "conv2_b": jnp.zeros((32,), jnp.float32),
        "dense_w": _he(k3, (32, NUM_CLASSES), 32),
        "dense_b": jnp.zeros((NUM_CLASSES,), jnp.float32),
    }


def _conv(x: jax.Array, w: jax.Array, b: jax.Array, stride: int, padding: str) -> jax.Array:
    y = jax.lax.conv_general_dilated(
        x, w, (stride, stride), padding, dimension_numbers=_DIMENSION_NUMBERS
    )
    return y + b[None, :, None, None]


def execute(params: dict[str, jax.Array], FORMATTED_IMAGE: jax.Array) -> dict[str, jax.Array]:
    """FORMATTED_IMAGE: float32 [B, 3, 224, 224] -> CLASSIFICATION_OUTPUT float32 [B, 1000]."""
    x = jnp.asarray(FORMATTED_IMAGE, jnp.float32)
    x = jax.nn.relu(_conv(x, params["conv1_w"], params["conv1_b"], 4, "SAME"))
    x = jax.nn.relu(_conv(x, params["conv2_w"], params["conv2_b"], 2, "SAME"))
    x = jnp.mean(x, axis=(2, 3))
    logits = x @ params["dense_w"] + params["dense_b"]
    return {"CLASSIFICATION_OUTPUT": jax.nn.softmax(logits, axis=-1).astype(jnp.float32)}
