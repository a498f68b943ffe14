import trio

JIT = False


async def execute(request, DELAY):
    await trio.sleep(float(DELAY[0]))
    return {"DELAY_OUT": DELAY}
