# smcd — two commands matter: `make demo` and `make test`. Everything else is a building block.
SHELL := /bin/bash
PY := /usr/bin/python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all deps venv demo test test-rdma lint typecheck pytest bench clean

all: test

deps:
	@bash tests/host/install-deps.sh

# pyverbs and systemd-python come from Debian, so the venv sees the system site-packages.
$(STAMP): pyproject.toml | deps
	@test -x $(VPY) || $(PY) -m venv --system-site-packages $(VENV)
	@$(VPY) -m pip install -q --upgrade pip >/dev/null
	@$(VPY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: deps $(STAMP)

lint: venv
	$(VENV)/bin/ruff check smcd_daemon smc_handoff tests bench
	$(VENV)/bin/ruff format --check smcd_daemon/wire

typecheck: venv
	$(VENV)/bin/mypy --strict smcd_daemon/wire

pytest: venv
	$(VPY) -m pytest $(PYTEST_ARGS)

test: venv lint typecheck pytest

# The RDMA part alone: boots the Soft-RoCE VM (qemu/TCG, two rxe devices per host) once.
test-rdma: venv
	$(VPY) -m pytest tests/vm $(PYTEST_ARGS)

demo: venv
	$(VPY) -m smcd_daemon.demo

bench: venv
	$(VPY) bench/run.py

# smcd SMC-R vs TCP inside the Soft-RoCE VM (bench/smcr_vm.py through the guest test
# test_smcr_bench, full volumes): one VM boot, then the table the guest wrote.
.PHONY: bench-rdma
BENCH_RDMA_TMP := .cache/bench-rdma
bench-rdma: venv
	@status=0; \
	SMCD_GUEST_BENCH_FULL=1 SMCD_VM_TIMEOUT=$${SMCD_VM_TIMEOUT:-2400} \
		$(VPY) -m pytest tests/vm -k test_smcr_bench -s -p no:cacheprovider \
		--basetemp=$(BENCH_RDMA_TMP) $(PYTEST_ARGS) || status=$$?; \
	echo; cat $(BENCH_RDMA_TMP)/vm-out0/smcr-bench.txt 2>/dev/null \
		|| echo "bench-rdma: no table was written (see the output above)"; \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
