"""Mirrors python_backend's examples/bls/async_model.py: an async execute awaits two
async_exec calls with asyncio.gather (one to a python model, one to a JAX model) and takes
OUTPUT0 from the first, OUTPUT1 from the second."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            calls = [
                pb_utils.InferenceRequest(
                    model_name=name,
                    requested_output_names=["OUTPUT0", "OUTPUT1"],
                    inputs=[in_0, in_1],
                ).async_exec()
                for name in ("add_sub", "jax_add_sub")
            ]
            answers = await asyncio.gather(*calls)
            for answer in answers:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
            out0 = pb_utils.get_output_tensor_by_name(answers[0], "OUTPUT0")
            out1 = pb_utils.get_output_tensor_by_name(answers[1], "OUTPUT1")
            responses.append(pb_utils.InferenceResponse([out0, out1]))
        return responses
