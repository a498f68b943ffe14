"""Preprocessing in JAX: uint8 HWC images -> float32 CHW, scaled to [0, 1] and normalised
with the ImageNet mean and standard deviation (jitted: one XLA call per batch)."""

import jax.numpy as jnp

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def execute(IMAGE):
    pixels = IMAGE.astype(jnp.float32) / 255.0
    pixels = (pixels - jnp.asarray(MEAN)) / jnp.asarray(STD)
    return {"PIXELS": jnp.transpose(pixels, (0, 3, 1, 2))}
