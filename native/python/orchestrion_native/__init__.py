"""orchestrion's native front end: HTTP/1.1, HTTP/2 and gRPC served by hyper on threads of
its own, requests handed to the interpreter's trio thread in batches.

``orchestrion serve`` uses it when installed (``--frontend auto``); its Python side is
``orchestrion.frontends._native``.
"""

from ._native import Frontend as Frontend

__all__ = ["Frontend"]
