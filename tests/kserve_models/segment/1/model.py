def execute(X):
    return {"SEG": -X}
