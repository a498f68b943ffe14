"""A pipeline whose best configuration is known, for ``orchestrion tune``'s tests: ``pipe``
(an ensemble) -> ``sleepy``, a python-backend model that sleeps 20 ms per request (a sleep
releases the GIL, so its instances run side by side on any machine). Its parameters:
``hold_mib`` (resident memory per instance), ``fail_above`` (its initialize refuses more
instances than that) and ``broken`` ("yes": every request fails)."""

from __future__ import annotations

import hashlib
from pathlib import Path

SLEEPY = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        count = sum(group["count"] for group in config["instance_group"])
        limit = int(parameters.get("fail_above", "0"))
        if limit and count > limit:
            raise RuntimeError(f"refusing {count} instances (this test allows {limit})")
        # Resident memory per instance, touched so that it counts.
        self.held = np.ones(int(parameters.get("hold_mib", "0")) * 2**18, np.float32)
        self.broken = parameters.get("broken") == "yes"

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(0.02)
            if self.broken:
                error = pb_utils.TritonError("broken on purpose")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return responses
"""

SLEEPY_CONFIG = """# A model that sleeps 20 ms per request.
name: "sleepy"
backend: "python"
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "execution" value: {{ string_value: "thread" }} }}
{extra}"""

PIPE_CONFIG = """# The ensemble a client calls.
name: "pipe"
platform: "ensemble"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "sleepy"
      model_version: -1
      input_map { key: "X" value: "IN" }
      output_map { key: "Y" value: "OUT" }
    }
  ]
}
"""


def sleepy_repository(root: Path, *, linked_config: bool = False, **parameters: str) -> Path:
    """The pipeline ``pipe`` -> ``sleepy`` in ``root/models`` (``linked_config``: sleepy's
    config file is a link to ``root/shared/sleepy.pbtxt``, outside the repository)."""
    extra = "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
        for k, v in parameters.items()
    )
    repository = root / "models"
    (repository / "sleepy" / "1").mkdir(parents=True)
    (repository / "sleepy" / "1" / "model.py").write_text(SLEEPY)
    config = repository / "sleepy" / "config.pbtxt"
    if linked_config:
        (root / "shared").mkdir()
        (root / "shared" / "sleepy.pbtxt").write_text(SLEEPY_CONFIG.format(extra=extra))
        config.symlink_to(root / "shared" / "sleepy.pbtxt")
    else:
        config.write_text(SLEEPY_CONFIG.format(extra=extra))
    (repository / "pipe" / "1").mkdir(parents=True)
    (repository / "pipe" / "config.pbtxt").write_text(PIPE_CONFIG)
    return repository


def fingerprint(root: Path) -> dict[str, str]:
    """Every file under ``root`` and its hash."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }
