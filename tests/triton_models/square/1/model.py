"""Mirrors python_backend's examples/decoupled/square_model.py: execute hands each
request's response sender to a thread of its own and returns; the thread sends n responses
and the final flag; finalize waits for the threads still sending."""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.running = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            with self.lock:
                self.running += 1
            threading.Thread(target=self._respond, args=(sender, n), daemon=True).start()
        return None

    def _respond(self, sender, n):
        try:
            for _ in range(n):
                if sender.is_cancelled():
                    break
                sender.send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))])
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.running -= 1

    def finalize(self):
        deadline = time.monotonic() + 10
        while self.running and time.monotonic() < deadline:
            time.sleep(0.01)
