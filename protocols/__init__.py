"""orchestrion's pure core: configs, data types, messages, ensemble graphs and their rules.

Nothing here does I/O or imports trio, so everything here can be tested synchronously and
reused by any front end.
"""

from ._config import DynamicBatching as DynamicBatching
from ._config import EnsembleScheduling as EnsembleScheduling
from ._config import EnsembleStep as EnsembleStep
from ._config import InstanceGroup as InstanceGroup
from ._config import InstanceKind as InstanceKind
from ._config import ModelConfig as ModelConfig
from ._config import ModelTransactionPolicy as ModelTransactionPolicy
from ._config import QueuePolicy as QueuePolicy
from ._config import Reshape as Reshape
from ._config import ResponseCache as ResponseCache
from ._config import SequenceBatching as SequenceBatching
from ._config import TensorConfig as TensorConfig
from ._config import VersionPolicy as VersionPolicy
from ._converter import configure_converter as configure_converter
from ._converter import format_model_config as format_model_config
from ._converter import make_converter as make_converter
from ._converter import model_config_from_dict as model_config_from_dict
from ._converter import model_config_to_dict as model_config_to_dict
from ._converter import parse_model_config as parse_model_config
from ._dtypes import DataType as DataType
from ._ensemble import EnsembleGraph as EnsembleGraph
from ._ensemble import StepPlan as StepPlan
from ._ensemble import validate_ensemble as validate_ensemble
from ._errors import ConfigError as ConfigError
from ._errors import InferenceError as InferenceError
from ._errors import InferenceTimeoutError as InferenceTimeoutError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import ModelNotFoundError as ModelNotFoundError
from ._errors import OrchestrionError as OrchestrionError
from ._errors import ServerClosedError as ServerClosedError
from ._messages import InferRequest as InferRequest
from ._messages import InferResponse as InferResponse
from ._messages import ParameterValue as ParameterValue
from ._messages import Tensors as Tensors
from ._observer import Observer as Observer
from ._requests import new_request as new_request
from ._statistics import DurationStatistics as DurationStatistics
from ._statistics import InferStatistics as InferStatistics
from ._statistics import ModelStatistics as ModelStatistics
from ._statistics import StepStatistics as StepStatistics
from ._tensors import TensorChecker as TensorChecker
from ._tensors import apply_reshape as apply_reshape
from ._tensors import check_inputs as check_inputs
from ._tensors import check_outputs as check_outputs
from ._tensors import match_batching as match_batching
from ._tensors import undo_reshape as undo_reshape
from ._validation import bytes_tensors as bytes_tensors
from ._validation import validate_model_config as validate_model_config
from ._validation import validate_repository as validate_repository
