"""Backends: how one model's code becomes something the runtime can call.

A backend loads a model's instances (initialise, place on a device, compile, warm up), runs
one execution (a request, or a batch of them joined on the batch dimension), opens a stream
for a decoupled model, and says what it can do (`Capabilities`); the runner decides from
those alone how to run it (inline or in a worker thread, batched, as a stream, with a
sequence's state). `backend_for` picks the backend of a `Model`. Four kinds exist: JAX
(``jax.jit``, device placement), plain Python (sync, async, generators), Triton's python
backend (``TritonPythonModel``, with ``triton_python_backend_utils``, BLS and response
senders) and ONNX Runtime (an ONNX graph, one session per instance).
"""

from ._asyncio_bridge import TrioBridge as TrioBridge
from ._asyncio_bridge import call_sync as call_sync
from ._base import Backend as Backend
from ._base import Capabilities as Capabilities
from ._base import LoadedInstance as LoadedInstance
from ._base import ServerCalls as ServerCalls
from ._code_files import forget_code as forget_code
from ._code_files import forget_model as forget_model
from ._code_files import import_code_file as import_code_file
from ._function import host_tensors as host_tensors
from ._function import response_on_host as response_on_host
from ._function_contract import contract_problems as contract_problems
from ._kinds import KINDS as KINDS
from ._kinds import BackendKind as BackendKind
from ._kinds import backend_for as backend_for
from ._kinds import check_model as check_model
from ._kinds import kind_of as kind_of
from ._kinds import model_problems as model_problems
from ._onnx import complete_onnx_config as complete_onnx_config
from ._response_order import RESPONSE_ORDER as RESPONSE_ORDER
from ._response_order import OrderedRequest as OrderedRequest
from ._response_order import ResponseOrder as ResponseOrder
from ._rows import concatenate as concatenate
from ._rows import join_inputs as join_inputs
from ._rows import repeat_last_row as repeat_last_row
from ._rows import rows_view as rows_view
from ._rows import split_outputs as split_outputs
from ._rows import take_rows as take_rows
from ._traced import TracedCall as TracedCall
from ._traced import on_default_device as on_default_device
from ._triton_config import auto_complete as auto_complete
from ._triton_config import stub_name_problem as stub_name_problem
