JIT = False


def execute(INPUT0):
    return {"OUTPUT0": INPUT0}
