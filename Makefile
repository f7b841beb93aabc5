# The two commands of the README. Each sets up its own virtual environment first.
#   make train   the main job: the demo preset on the embedded defaults (stdlib corpus, SQLite MLflow, ephemeral Prefect)
#   make test    ruff + the whole test suite (end-to-end tests included)
#   make services / make services-down   PostgreSQL + Prefect server + MLflow server on free local ports
#                (data under .llamaflow/services, or SERVICES_DIR=...); prints the two URLs to export.
#                Authentication is always on (NO_AUTH=1: off, loopback only, for a throwaway directory);
#                HOST=0.0.0.0 (or an address) listens beyond loopback, over TLS (stunnel4; TLS=1 on loopback too;
#                TLS_CERT=.. TLS_KEY=.. your certificate). Credentials and CA bundle: SERVICES_DIR/env.sh (0600).
#   make services-user NAME=worker   a least-privilege MLflow user for workers (EXPERIMENTS="a b", MODELS="m";
#                ROLE=promoter: may also move aliases, for the registering flow; ROLE=reader: reads only)
#   make gpu-wheels   the cp312 wheels benchmarks/gpu_check.py needs beyond the GPU image (pydantic and its
#                dependencies), into the git-ignored .whl/ (the check's header has the command to run there)
PYTHON ?= python3.11
VENV ?= .venv
# CPU machines take PyTorch's CPU wheel; a CUDA machine (nvidia-smi present) takes the CUDA build.
# Override with `make ... TORCH_CONSTRAINT=` (CUDA) or `TORCH_CONSTRAINT="-c constraints-cpu.txt"` (CPU).
TORCH_CONSTRAINT ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install train tiny test lint bench clean services services-down services-user gpu-wheels
SERVICES_DIR ?=
HOST ?=
NO_AUTH ?=
TLS ?=
TLS_CERT ?=
TLS_KEY ?=
ROLE ?=
NAME ?= worker
EXPERIMENTS ?=
MODELS ?=
SERVICES_ARGS = $(if $(SERVICES_DIR),--dir $(SERVICES_DIR))
SERVICES_UP_ARGS = $(SERVICES_ARGS) $(if $(HOST),--host $(HOST)) $(if $(filter 1 yes true on,$(NO_AUTH)),--no-auth) \
	$(if $(filter 1 yes true on,$(TLS)),--tls) $(if $(TLS_CERT),--tls-cert $(TLS_CERT) --tls-key $(TLS_KEY))

# Install also migrates the embedded Prefect server's database (PREFECT_HOME), once, instead of the first run
# (8-10 s of a cold `make train` on 2 cores).
# The installer: uv (put into the venv by pip) installs the same set as pip, with pip's sources and constraints
# (.ci/uv_options.py), in a fraction of pip's time (benchmarks/results/install_time.json). pip is the
# fallback when uv cannot be had or fails; INSTALLER=pip uses pip alone.
INSTALLER ?= uv
INSTALL_SPEC = $(TORCH_CONSTRAINT) -e '.[dev,postgres,auth,dask]'
PIP_INSTALL = $(VENV)/bin/python -m pip install --quiet --disable-pip-version-check
$(STAMP): pyproject.toml constraints-cpu.txt .ci/uv_options.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	if [ "$(INSTALLER)" = uv ] && $(PIP_INSTALL) uv && $(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python \
		$$($(VENV)/bin/python .ci/uv_options.py) -C editable_mode=compat $(INSTALL_SPEC); then :; \
	else $(PIP_INSTALL) --config-settings editable_mode=compat $(INSTALL_SPEC); fi
	$(VENV)/bin/prefect server database upgrade -y > /dev/null
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python -m flows.pretrain --preset demo $(ARGS)

tiny: $(STAMP)
	$(VENV)/bin/python -m flows.pretrain --preset tiny $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Test files are spread over TEST_WORKERS processes, each file whole on one (its module fixtures start once);
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/python -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(ARGS)

# The GPU machines' image: Python 3.12, torch, transformers, tokenizers, safetensors, numpy; no pydantic.
# Its requirement (the version bound) is read from pyproject.toml, so the wheels match what the code needs.
GPU_WHEELS ?= pydantic
gpu-wheels:
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --dest .whl --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
		$$($(PYTHON) -c "import re, sys, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
		print(' '.join(d for d in deps if re.split('[<>=!~ ;\\[]', d)[0] in sys.argv[1:]))" $(GPU_WHEELS))
	@ls .whl

services: $(STAMP)
	$(VENV)/bin/python -m flows.services up $(SERVICES_UP_ARGS)

services-user: $(STAMP)
	$(VENV)/bin/python -m flows.services add-user $(NAME) $(SERVICES_ARGS) \
		$(foreach e,$(EXPERIMENTS),--experiment $(e)) $(foreach m,$(MODELS),--model $(m)) \
		$(if $(filter promoter,$(ROLE)),--promoter) $(if $(filter reader,$(ROLE)),--read-only)

services-down: $(STAMP)
	$(VENV)/bin/python -m flows.services down $(SERVICES_ARGS)

clean:
	rm -rf .llamaflow .pytest_cache
