# The two commands of the README:
#   make run    set up, then train the built-in default (tiny SDXL, synthetic data, ZeRO-2)
#   make test   set up, then run the test suite
# PYTHON selects the interpreter (a venv's python, for example); setup installs into it.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0

.PHONY: setup system-deps ops run test test-long lint

# torch first, and only when missing: a torch the user already has (CUDA build, nightly) is kept,
# and nothing below pulls a second one. DeepSpeed builds against that torch (no build isolation).
setup: system-deps
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	@$(PYTHON) -c "import deepspeed" 2>/dev/null || \
		DS_BUILD_OPS=0 $(PYTHON) -m pip install --no-build-isolation "deepspeed==0.19.8"
	$(PYTHON) -m pip install -e ".[test]"
	-$(MAKE) ops

# DeepSpeed's ops (ZeRO's Adam, offload Adam/Adagrad/Lion, NVMe's async_io) built now rather than at the
# first run of each node; set TORCH_EXTENSIONS_DIR to a folder every node sees (see the README).
ops:
	$(PYTHON) -m ds_trainer.tools.ops

# libaio-dev for DeepSpeed's async_io op (NVMe offload); Debian's Slurm and munge for the local
# SLURM cluster (`python -m ds_trainer.slurm_local start`) the sweep tests submit to; iproute2 for its
# two-node form (`--nodes 2`: network namespaces). Installed when running as root (a policy-rc.d keeps
# the packages from starting their daemons); otherwise listed.
SYSTEM_PACKAGES = libaio-dev slurmctld slurmd slurm-client munge iproute2
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		guard=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
			chmod +x /usr/sbin/policy-rc.d; guard=1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		status=$$?; [ -n "$$guard" ] && rm -f /usr/sbin/policy-rc.d; exit $$status; \
	else echo "system packages missing (install them for NVMe offload and SLURM tests): $$missing"; fi

run: setup
	$(PYTHON) -m ds_trainer

test: setup
	$(PYTHON) -m pytest

# The exhaustive variants the default suite leaves out (more zero x offload cells, kill moments, a real
# Slurm time limit).
test-long: setup
	$(PYTHON) -m pytest -m long

lint:
	$(PYTHON) -m ruff check ds_trainer tests
	$(PYTHON) -m mypy
