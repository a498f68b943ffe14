"""A jitted JAX model (the model.py contract) that declares OUTPUT0 and OUTPUT1 and
returns only OUTPUT0."""


def execute(INPUT0, INPUT1):
    return {"OUTPUT0": INPUT0 + INPUT1}
