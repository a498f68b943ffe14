"""The front ends: everything ``orchestrion serve`` and the ``orchestrion`` command are made of.

The HTTP/1.1 server and Triton's HTTP routes, the gRPC service and its crossing to trio, model
control modes, ``serve`` itself and the CLI. They sit above the embedding API
(``orchestrion.open_server``) and talk to the runtime only through it; the wire formats they
speak are ``orchestrion.protocols``.
"""

from ._cli import main as main
