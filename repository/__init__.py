"""A Triton model repository on disk, read: its model folders, their versions and code, and
what a load request reads (Triton's repository layout and load API).

How this works. `scan_repository` reads the folders of a repository root (`RepositoryEntry`:
a folder's config, as `ConfigReading` says to read it: auto-complete, ``--model-config-name``,
``--backend-directory``), `load_model_code` imports one version's code into a `Model`
(``model.py``, a ``TritonPythonModel``, a ``model.onnx``), with its revision (a fingerprint of
its files), labels and initial states. `read_repository` and `scan_closure` read what a load
needs (an ensemble with the models its steps use). A load request (`plan_load`) may bring a
config override and uploaded files (`UploadFolders`, written without following links). The
registry (``orchestrion.actors``) and the front ends (``orchestrion.frontends``) use this
package and nothing below it.
"""

from ._entries import CONFIG_FILE as CONFIG_FILE
from ._entries import DEFAULT_MODEL_FILE as DEFAULT_MODEL_FILE
from ._entries import DEFAULT_ONNX_FILE as DEFAULT_ONNX_FILE
from ._entries import RepositoryEntry as RepositoryEntry
from ._entries import revision as revision
from ._folders import AUTO_COMPLETE as AUTO_COMPLETE
from ._folders import TRITON_BACKEND_DIRECTORY as TRITON_BACKEND_DIRECTORY
from ._folders import ConfigReading as ConfigReading
from ._folders import is_model_folder as is_model_folder
from ._folders import load_model_code as load_model_code
from ._folders import scan_model_folder as scan_model_folder
from ._folders import scan_repository as scan_repository
from ._load_plans import LoadPlan as LoadPlan
from ._load_plans import folder_fingerprint as folder_fingerprint
from ._load_plans import plan_load as plan_load
from ._load_plans import relative_paths as relative_paths
from ._reader import find_model_folder as find_model_folder
from ._reader import load_code as load_code
from ._reader import read_repository as read_repository
from ._reader import scan_closure as scan_closure
from ._uploads import UploadFolders as UploadFolders
from ._uploads import open_upload_folders as open_upload_folders
