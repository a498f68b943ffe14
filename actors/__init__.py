"""The runtime: model instances, ensemble steps and the registry, as trio actors."""

from ..protocols import Model as Model
from ._ensemble import EnsembleRunner as EnsembleRunner
from ._ensemble_runs import Step as Step
from ._fusion import Fusion as Fusion
from ._instances import SWITCH_WINDOW as SWITCH_WINDOW
from ._instances import Instance as Instance
from ._listed_fusion import ListedFusion as ListedFusion
from ._load_lock import LoadLock as LoadLock
from ._registry import ModelRegistry as ModelRegistry
from ._request_router import ModelControlCalls as ModelControlCalls
from ._runner import ModelRunner as ModelRunner
from ._watchdog import watch_event_loop as watch_event_loop
