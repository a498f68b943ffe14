"""The runtime: model instances, ensemble steps and the registry, as trio actors."""

from ._definition import Model as Model
from ._definition import check_model as check_model
from ._ensemble import EnsembleRunner as EnsembleRunner
from ._registry import ModelRegistry as ModelRegistry
from ._repository import RepositoryEntry as RepositoryEntry
from ._repository import load_model_code as load_model_code
from ._repository import scan_repository as scan_repository
from ._runner import ModelRunner as ModelRunner
