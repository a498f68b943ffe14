"""The front ends: everything ``orchestrion serve`` and the ``orchestrion`` command are made of.

The HTTP/1.1 server and Triton's HTTP routes, the gRPC service and its crossing to trio, model
control modes, ``serve`` itself and the CLI. They sit above the embedding API
(``orchestrion.open_server``) and talk to the runtime only through it; the wire formats they
speak are ``orchestrion.protocols``. Besides ``main`` (the ``orchestrion`` command), this face
offers what runs the front ends in-process around a server (``serve``, ``serve_http_api``,
``serve_grpc_api``, ``serve_native``, model control), which ``orchestrion.testing`` uses.
"""

from ._cli import main as main
from ._control import ModelControl as ModelControl
from ._control import ModelControlMode as ModelControlMode
from ._control import Shutdown as Shutdown
from ._grpc_service import DirectCalls as DirectCalls
from ._grpc_service import InferenceService as InferenceService
from ._grpc_service import serve_grpc_api as serve_grpc_api
from ._http_api import HttpApi as HttpApi
from ._http_api import serve_http_api as serve_http_api
from ._native import native_available as native_available
from ._native import serve_native as serve_native
from ._serve import ServeOptions as ServeOptions
from ._serve import serve as serve
