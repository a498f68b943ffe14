JIT = False


def execute(Y):
    return {"Z": Y * Y}
