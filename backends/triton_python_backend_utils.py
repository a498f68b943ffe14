"""Triton's ``triton_python_backend_utils`` for python-backend models served by orchestrion.

A Triton model's ``model.py`` does ``import triton_python_backend_utils as pb_utils``; this
module (installed with orchestrion, top-level for that reason alone) gives it the same names,
implemented in ``orchestrion.backends``. A model's own unit tests can import it too: tensors,
responses, errors, the auto-complete ``ModelConfig``, the logger and metric families work
outside a server; calls into a server (BLS) need the model to run in one. What differs from
Triton is listed in docs/guide.md, "Bringing a Triton repository".
"""

from orchestrion.backends._triton_api import TRITON_STRING_TO_NUMPY as TRITON_STRING_TO_NUMPY
from orchestrion.backends._triton_api import (
    TRITONSERVER_MEMORY_CPU as TRITONSERVER_MEMORY_CPU,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_MEMORY_CPU_PINNED as TRITONSERVER_MEMORY_CPU_PINNED,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_MEMORY_GPU as TRITONSERVER_MEMORY_GPU,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END as TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START as TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_REQUEST_RELEASE_ALL as TRITONSERVER_REQUEST_RELEASE_ALL,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE as TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
)
from orchestrion.backends._triton_api import (
    TRITONSERVER_RESPONSE_COMPLETE_FINAL as TRITONSERVER_RESPONSE_COMPLETE_FINAL,
)
from orchestrion.backends._triton_api import InferenceResponse as InferenceResponse
from orchestrion.backends._triton_api import PreferredMemory as PreferredMemory
from orchestrion.backends._triton_api import Tensor as Tensor
from orchestrion.backends._triton_api import TritonError as TritonError
from orchestrion.backends._triton_api import TritonModelException as TritonModelException
from orchestrion.backends._triton_api import (
    deserialize_bytes_tensor as deserialize_bytes_tensor,
)
from orchestrion.backends._triton_api import (
    get_input_config_by_name as get_input_config_by_name,
)
from orchestrion.backends._triton_api import (
    get_input_tensor_by_name as get_input_tensor_by_name,
)
from orchestrion.backends._triton_api import (
    get_output_config_by_name as get_output_config_by_name,
)
from orchestrion.backends._triton_api import (
    get_output_tensor_by_name as get_output_tensor_by_name,
)
from orchestrion.backends._triton_api import numpy_to_triton_type as numpy_to_triton_type
from orchestrion.backends._triton_api import serialize_byte_tensor as serialize_byte_tensor
from orchestrion.backends._triton_api import triton_string_to_numpy as triton_string_to_numpy
from orchestrion.backends._triton_api import triton_to_numpy_type as triton_to_numpy_type
from orchestrion.backends._triton_api import (
    using_decoupled_model_transaction_policy as using_decoupled_model_transaction_policy,
)
from orchestrion.backends._triton_calls import ResponseIterator as ResponseIterator
from orchestrion.backends._triton_config import ModelConfig as ModelConfig
from orchestrion.backends._triton_metrics import Logger as Logger
from orchestrion.backends._triton_metrics import Metric as Metric
from orchestrion.backends._triton_metrics import MetricFamily as MetricFamily
from orchestrion.backends._triton_metrics import get_model_dir as get_model_dir
from orchestrion.backends._triton_requests import InferenceRequest as InferenceRequest
from orchestrion.backends._triton_requests import (
    InferenceResponseSender as InferenceResponseSender,
)
from orchestrion.backends._triton_requests import is_model_ready as is_model_ready
from orchestrion.backends._triton_requests import load_model as load_model
from orchestrion.backends._triton_requests import unload_model as unload_model
