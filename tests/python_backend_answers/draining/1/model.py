"""Not ready while a flag file exists beside the repository (python_backend's README:
``is_ready`` for a graceful drain); it serves requests all the same."""

import os
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.flag = os.environ.get("ORCHESTRION_TEST_DRAIN_FLAG", "")

    def is_ready(self):
        return not (self.flag and Path(self.flag).exists())

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
            )
            for r in requests
        ]
