"""Postprocessing in JAX: softmax over the logits and the index of the top class."""

import jax
import jax.numpy as jnp


def execute(LOGITS):
    return {
        "PROBABILITIES": jax.nn.softmax(LOGITS, axis=-1),
        "LABEL": jnp.argmax(LOGITS, axis=-1).astype(jnp.int32)[:, None],
    }
