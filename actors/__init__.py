"""The runtime: model instances, ensemble steps and the registry, as trio actors."""

from ..protocols import Model as Model
from ._ensemble import EnsembleRunner as EnsembleRunner
from ._ensemble_scheduler import Step as Step
from ._fusion import Fusion as Fusion
from ._instances import SWITCH_WINDOW as SWITCH_WINDOW
from ._instances import Instance as Instance
from ._listed_fusion import ListedFusion as ListedFusion
from ._load_lock import LoadLock as LoadLock
from ._model_files import CONFIG_FILE as CONFIG_FILE
from ._model_files import RepositoryEntry as RepositoryEntry
from ._registry import ModelRegistry as ModelRegistry
from ._repository import AUTO_COMPLETE as AUTO_COMPLETE
from ._repository import TRITON_BACKEND_DIRECTORY as TRITON_BACKEND_DIRECTORY
from ._repository import ConfigReading as ConfigReading
from ._repository import is_model_folder as is_model_folder
from ._repository import load_model_code as load_model_code
from ._repository import scan_model_folder as scan_model_folder
from ._repository import scan_repository as scan_repository
from ._repository_reader import find_model_folder as find_model_folder
from ._repository_reader import load_code as load_code
from ._repository_reader import scan_closure as scan_closure
from ._request_router import ModelControlCalls as ModelControlCalls
from ._runner import ModelRunner as ModelRunner
from ._watchdog import watch_event_loop as watch_event_loop
