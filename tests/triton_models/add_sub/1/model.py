"""Mirrors python_backend's examples/add_sub: reads its output types from the config JSON
that initialize receives, answers each request with sum and difference."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        out0 = pb_utils.get_output_config_by_name(config, "OUTPUT0")
        out1 = pb_utils.get_output_config_by_name(config, "OUTPUT1")
        self.dtype0 = pb_utils.triton_string_to_numpy(out0["data_type"])
        self.dtype1 = pb_utils.triton_string_to_numpy(out1["data_type"])
        pb_utils.Logger.log_info(f"initialized instance {args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", (a + b).astype(self.dtype0)),
                        pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype1)),
                    ]
                )
            )
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("finalized")
