"""Reads the parameters of the responses of a plain and a decoupled BLS call."""

import json

import triton_python_backend_utils as pb_utils


def _call(model, tensor, decoupled):
    request = pb_utils.InferenceRequest(
        model_name=model,
        inputs=[pb_utils.Tensor("PARAMETERS", tensor.as_numpy())],
        requested_output_names=["OUT"],
    )
    return request.exec(decoupled=decoupled)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            plain = _call("params", pb_utils.get_input_tensor_by_name(request, "PARAMETERS"), False)
            streamed = _call(
                "params_stream",
                pb_utils.get_input_tensor_by_name(request, "STREAM_PARAMETERS"),
                True,
            )
            seen = {
                "plain": json.loads(plain.parameters()),
                "stream": [json.loads(r.parameters()) for r in streamed if r.output_tensors()],
            }
            out = pb_utils.Tensor("OUT", [json.dumps(seen).encode()])
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
