# The two commands of the README:
#   make run    set up, then train the built-in default (tiny SDXL, synthetic data, ZeRO-2)
#   make test   set up, then run the test suite
#
# Where setup installs: into the Python environment you run it from when that is a virtual or conda
# environment (yours, used as it is); otherwise into .venv/ in this checkout, made from $(PYTHON) (a system
# Python: Debian's and Ubuntu's refuse pip installs, PEP 668). The .venv sees the system's packages, so a torch
# already installed there (a container's CUDA build) is kept. PYTHON picks the interpreter; VENV=no installs
# into it as it is.
PYTHON ?= python3
VENV ?= auto
VENV_DIR ?= .venv
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
# The versions CI tested: every install goes through them (`make lock` moves them, see the README).
CONSTRAINTS ?= constraints.txt
PYTEST_ARGS ?=

OWN_ENV := $(shell $(PYTHON) -c 'import os, sys; print(int(sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))))' 2>/dev/null)
ifeq ($(VENV)$(OWN_ENV),auto0)
PY := $(abspath $(VENV_DIR))/bin/python
# The venv's commands (accelerate, torchrun, ...) come first, as if it were activated.
RUN := PATH="$(abspath $(VENV_DIR))/bin:$$PATH"
else
PY := $(PYTHON)
RUN :=
endif
PIP := $(PY) -m pip install --disable-pip-version-check -c $(CONSTRAINTS)

.PHONY: setup system-deps python ops run test test-long lint lock upgrade wheelhouse gpucheck rehearse

# torch first, and only when missing: a torch the user already has (CUDA build, nightly) is kept, and nothing
# below pulls a second one (the constraints leave torch out). DeepSpeed builds against that torch (no build
# isolation); its ops are compiled by `make ops` (in the background while the rest installs).
setup: system-deps python
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) "torch==$(TORCH_VERSION)"
	@$(PY) -c "import deepspeed" 2>/dev/null || \
		DS_BUILD_OPS=0 $(PIP) --no-build-isolation "deepspeed==$(DEEPSPEED_VERSION)"
	@log=$$(mktemp); $(RUN) $(PY) -m ds_trainer.tools.ops > $$log 2>&1 & ops=$$!; \
		$(PIP) -e ".[test]"; status=$$?; wait $$ops; cat $$log; rm -f $$log; exit $$status

# The interpreter setup installs into: the .venv is made on first use.
python:
	@if [ "$(PY)" = "$(abspath $(VENV_DIR))/bin/python" ] && [ ! -x "$(PY)" ]; then \
		echo "making $(VENV_DIR)/ from $(PYTHON) (not a virtual or conda environment; VENV=no to install into it)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV_DIR) || { echo "$(PYTHON) cannot make a virtual environment:" \
			"install Debian/Ubuntu's python3-venv (apt-get install python3-venv), or pass PYTHON=<another python>"; \
			exit 1; }; \
	fi

# DeepSpeed's ops (ZeRO's Adam, offload Adam/Adagrad/Lion, NVMe's async_io) built now rather than at the first
# run of each node; set TORCH_EXTENSIONS_DIR to a folder every node sees (see the README).
ops:
	$(RUN) $(PY) -m ds_trainer.tools.ops

# libaio-dev for DeepSpeed's async_io op (NVMe offload); Debian's Slurm and munge for the local SLURM cluster
# (`python -m ds_trainer.slurm_local start`) the sweep tests submit to; iproute2 for its two-node form
# (`--nodes 2`: network namespaces); python3-venv for the .venv; g++ and python3-dev for DeepSpeed's ops (they
# compile on this machine; `python -m ds_trainer.doctor` says what is missing). Installed when running as root (a policy-rc.d
# keeps the packages from starting their daemons); otherwise listed.
SYSTEM_PACKAGES = libaio-dev g++ python3-dev slurmctld slurmd slurm-client munge iproute2 python3-venv
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ] || ! command -v dpkg >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		guard=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
			chmod +x /usr/sbin/policy-rc.d; guard=1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		status=$$?; [ -n "$$guard" ] && rm -f /usr/sbin/policy-rc.d; exit $$status; \
	else echo "system packages missing (install them for NVMe offload, the SLURM tests and the .venv): $$missing"; fi

run: setup
	$(RUN) $(PY) -m ds_trainer

# Two workers (pytest-xdist): most of a test's time is a process starting (imports, one core), so two run side
# by side on two cores; the tests of one local Slurm cluster share one worker.
test: setup
	$(RUN) $(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The exhaustive variants the default suite leaves out (more zero x offload cells, kill moments, a real Slurm
# time limit, a longer fuzz).
test-long: setup
	$(RUN) $(PY) -m pytest -n 2 --dist loadgroup -m long $(PYTEST_ARGS)

# The wheels a GPU machine without network lacks, for CPython 3.12 manylinux x86-64 at the versions of
# constraints.txt, in sets of at most 60 MiB: .wheelhouse/core (the run path), bnb (optimizer=adamw8bit), wandb
# (logger=wandb). Needs the network here; docs/gpu-check.md says how to install and run them there.
wheelhouse: setup
	$(RUN) $(PY) -m ds_trainer.gpucheck.wheelhouse --out .wheelhouse --constraints $(CONSTRAINTS)

# The GPU check's CPU form (python -m ds_trainer.gpucheck --cpu): every step a CPU can run, tiny models.
gpucheck: setup
	$(RUN) $(PY) -m ds_trainer.gpucheck --cpu --out outputs/gpucheck-cpu

# The GPU check's two device calls rehearsed here: their exact commands under the device tool's limits
# (600 s a call with the install, 64 MiB of tree and wheels, 8 files of 16 MiB back); fails on a broken one.
rehearse: wheelhouse
	$(RUN) $(PY) -m ds_trainer.gpucheck.rehearse

lint:
	$(RUN) $(PY) -m ruff check ds_trainer tests
	$(RUN) $(PY) -m mypy

# New versions of the dependencies: resolve them afresh in a scratch environment (torch and DeepSpeed at the
# versions above), write constraints.txt, then run the tests with them. Commit constraints.txt with the fixes
# the tests ask for.
LOCK_ENV ?= /tmp/ds_trainer-lock
lock:
	rm -rf $(LOCK_ENV) && $(PYTHON) -m venv $(LOCK_ENV)
	$(LOCK_ENV)/bin/python -m pip install -q --disable-pip-version-check "torch==$(TORCH_VERSION)"
	DS_BUILD_OPS=0 $(LOCK_ENV)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
		"deepspeed==$(DEEPSPEED_VERSION)"
	$(LOCK_ENV)/bin/python -m pip install -q --disable-pip-version-check ".[test]"
	{ echo "# Written by make lock ($$(date -u +%Y-%m-%d), Python $$($(LOCK_ENV)/bin/python -c 'import platform; print(platform.python_version())')): the versions setup installs and CI tests."; \
	  echo "# torch is left out: setup keeps the torch you have (install the build you want first)."; \
	  $(LOCK_ENV)/bin/python -m pip freeze --exclude-editable --all | grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]+|pip|setuptools|wheel)==|^ds[-_]trainer[ =@]'; \
	} > $(CONSTRAINTS)
	rm -rf $(LOCK_ENV)

upgrade: lock test
