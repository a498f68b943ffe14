JIT = False


def execute(INPUT):
    return {"OUTPUT": INPUT}
