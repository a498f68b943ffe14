"""Mirrors python_backend's examples/bls_decoupled/async_model.py: two
async_exec(decoupled=True) calls gathered, then each iterator read to its end."""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        in_tensor = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        calls = [
            pb_utils.InferenceRequest(
                model_name="square", inputs=[in_tensor], requested_output_names=["OUT"]
            ).async_exec(decoupled=True)
            for _ in range(2)
        ]
        total = np.array([0], np.int32)
        for responses in await asyncio.gather(*calls):
            for response in responses:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if response.output_tensors():
                    total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)])]
