def execute(INPUT):
    return {"PRE": INPUT * 2.0 + 1.0}
