# The two commands of the README. Each sets up its own virtual environment first.
#   make train   the main job: the demo preset on the embedded defaults (stdlib corpus, SQLite MLflow, ephemeral Prefect)
#   make test    ruff + the whole test suite (end-to-end tests included)
#   make services / make services-down   PostgreSQL + Prefect server + MLflow server on free local ports
#                (data under .llamaflow/services, or SERVICES_DIR=...); prints the two URLs to export
PYTHON ?= python3.11
VENV ?= .venv
# CPU machines take PyTorch's CPU wheel; a CUDA machine (nvidia-smi present) takes the CUDA build.
# Override with `make ... TORCH_CONSTRAINT=` (CUDA) or `TORCH_CONSTRAINT="-c constraints-cpu.txt"` (CPU).
TORCH_CONSTRAINT ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install train tiny test lint bench clean services services-down
SERVICES_DIR ?=
SERVICES_ARGS = $(if $(SERVICES_DIR),--dir $(SERVICES_DIR))

# Install also migrates the embedded Prefect server's database (PREFECT_HOME), once, instead of the first run
# (8-10 s of a cold `make train` on 2 cores).
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH_CONSTRAINT) --config-settings editable_mode=compat -e '.[dev,postgres]'
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

test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/python -m pytest $(ARGS)

services: $(STAMP)
	$(VENV)/bin/python -m flows.services up $(SERVICES_ARGS)

services-down: $(STAMP)
	$(VENV)/bin/python -m flows.services down $(SERVICES_ARGS)

clean:
	rm -rf .llamaflow .pytest_cache
