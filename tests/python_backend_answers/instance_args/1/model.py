"""Answers with the args its instance's initialize received."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = {k: v for k, v in args.items() if k != "model_config"}

    def execute(self, requests):
        out = pb_utils.Tensor("OUT", [json.dumps(self.args).encode()])
        return [pb_utils.InferenceResponse([out]) for _ in requests]
