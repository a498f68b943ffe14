"""orchestrion for asyncio applications (FastAPI, aiohttp, ...).

``async with orchestrion.aio.open_server(model_repository="models/") as server:`` then
``await server.infer(...)``: the same server as `orchestrion.open_server` (trio), with every
call awaited on the application's own asyncio loop, no thread per request, and cancellation
crossing both ways. See docs/guide.md, "Embedding API".
"""

from ._aio import AioServer as AioServer
from ._aio import open_server as open_server
