"""add_sub in JAX (the model.py contract, jitted)."""


def execute(INPUT0, INPUT1):
    return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}
