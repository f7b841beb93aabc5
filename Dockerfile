# The GPU worker image: CUDA PyTorch, llamaflow's dependencies and Prefect, for a docker (or kubernetes)
# work pool. Each flow run's container clones the deployed commit and installs it on top (prefect.yaml's
# pull steps); the dependencies are already here, so that install takes seconds and downloads nothing.
#
#   docker build -t registry.example.com/llamaflow-gpu:latest .
#   docker run --rm --gpus all registry.example.com/llamaflow-gpu:latest \
#     python -c "import torch; print(torch.cuda.is_available())"
#
# PyPI's Linux torch wheel is the CUDA build and brings its own CUDA runtime: the host needs only the NVIDIA
# driver and the NVIDIA Container Toolkit (`--gpus`, or `device_requests` in the docker pool). See
# docs/production.md.
FROM python:3.11-slim

# git: the pull step's clone. gcc: torch.compile (inductor and Triton) builds kernels on the fly.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation: the pull step builds the cloned project
# with the setuptools installed below, without downloading one. LLAMAFLOW_HOME: caches, checkpoints and
# compiled kernels; mount a volume there so they outlive the container.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_BUILD_ISOLATION=0 \
    LLAMAFLOW_HOME=/data/llamaflow

WORKDIR /opt/llamaflow

# The dependencies, in their own layer: rebuilt only when pyproject.toml changes. The CUDA torch comes from
# PyPI, pinned to the version CI tests (constraints-cpu.txt's, without its +cpu: the CUDA build of it).
COPY pyproject.toml README.md constraints-cpu.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
x = p['optional-dependencies']; print('\n'.join(p['dependencies'] + x['postgres'] + x['gpu']))" \
    > /tmp/requirements.txt \
    && sed 's/+cpu$//' constraints-cpu.txt > /tmp/torch-pin.txt \
    && pip install -c /tmp/torch-pin.txt -r /tmp/requirements.txt "setuptools>=70.1" prefect-docker prefect-kubernetes

# The project at the image's own commit, for deployments that run it without a pull step.
COPY flows flows
COPY tasks tasks
COPY model model
COPY prefect.yaml constraints-cpu.txt ./
RUN pip install --no-deps . && mkdir -p "$LLAMAFLOW_HOME"

# Checks the Prefect and MLflow credentials it was given (docker run --env-file worker.env, a Kubernetes
# Secret), then becomes `prefect worker start`; see docs/production.md section 3.
CMD ["python", "-m", "flows.pool.worker", "--pool", "gpu-pool"]
