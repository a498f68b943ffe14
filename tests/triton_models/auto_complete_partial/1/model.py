"""Mirrors python_backend's examples/auto_complete/batch_model.py, in a folder without
config.pbtxt: auto_complete_config declares the inputs, outputs, max_batch_size 4 and the
dynamic batcher."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        have_inputs = {i["name"] for i in config["input"]}
        have_outputs = {o["name"] for o in config["output"]}
        for name in ("INPUT0", "INPUT1"):
            if name not in have_inputs:
                auto_complete_model_config.add_input(
                    {"name": name, "data_type": "TYPE_FP32", "dims": [4]}
                )
        for name in ("OUTPUT0", "OUTPUT1"):
            if name not in have_outputs:
                auto_complete_model_config.add_output(
                    {"name": name, "data_type": "TYPE_FP32", "dims": [4]}
                )
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
                )
            )
        return responses
