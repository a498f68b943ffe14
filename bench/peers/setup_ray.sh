#!/usr/bin/env bash
# Creates bench/.venv-ray (Ray Serve peer), idempotently. Run from anywhere.
# Never installs into orchestrion's .venv. About 1.1 GB, ~30 s with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x bench/.venv-ray/bin/python ] || python3 -m venv bench/.venv-ray
bench/.venv-ray/bin/pip install -q \
    "ray[serve]==2.60.0" "jax==0.10.2" "jaxlib==0.10.2" "numpy==2.4.6" \
    "pillow==13.0.0" "psutil==7.2.2"
bench/.venv-ray/bin/python -c "import ray, jax, PIL, psutil; print('ray', ray.__version__, 'jax', jax.__version__)"
