# The image of examples/kubernetes/jobset.yaml (docs/fault_tolerance.md, "Kubernetes: a JobSet"):
# jaxcolossal and jax with its CUDA 12 wheels, the repository at /workspace/jaxcolossal (the manifest's
# workingDir), so that `python -m jaxcolossal.run ... scripts/train.py --config configs/...` runs as in a clone.
#
#   docker build -t <your registry>/jaxcolossal:0.1.0 .
#   docker push <your registry>/jaxcolossal:0.1.0
#
# The base holds the CUDA user-space libraries' loader and the NVIDIA container runtime's hooks; jax[cuda12]
# brings its own CUDA, cuDNN and NCCL wheels, so the host needs only an NVIDIA driver (>= 525 for CUDA 12).
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /workspace/jaxcolossal
COPY . .
RUN pip install --upgrade pip \
    && pip install "jax[cuda12]" -e ".[data]" \
    && python -c "import jaxcolossal, jax; print('jaxcolossal', jaxcolossal.__version__, 'jax', jax.__version__)"

# NCCL between the 8 processes of a pod goes through /dev/shm: the manifest mounts a memory-backed one
CMD ["python", "-m", "jaxcolossal.run", "--help"]
