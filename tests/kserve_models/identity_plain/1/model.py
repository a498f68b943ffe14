"""Echoes each IN_<type> given as OUT_<type>."""

JIT = False


def execute(**inputs):
    return {"OUT_" + name[3:]: value for name, value in inputs.items()}
