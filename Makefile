# smcd — two commands matter: `make demo` and `make test`. Everything else is a building block.
SHELL := /bin/bash
PY := /usr/bin/python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all deps venv demo test test-rdma lint typecheck pytest bench clean fuzz soak

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

# The layer contract ([tool.importlinter] in pyproject.toml: wire -> protocol -> core -> transport
# -> adapters -> faces; smc_handoff imports nothing of the daemon) is part of lint.
lint: venv
	$(VENV)/bin/ruff check smcd_daemon smc_handoff tests bench
	$(VENV)/bin/ruff format --check smcd_daemon smc_handoff
	$(VENV)/bin/lint-imports --no-cache

typecheck: venv
	$(VENV)/bin/mypy --strict smcd_daemon smc_handoff

pytest: venv bpf
	$(VPY) -m pytest $(PYTEST_ARGS)

# The peer-detection eBPF object (README "Peer detection"): clang at build time, libbpf at run time.
.PHONY: bpf
BPF_OBJ := build/bpf/smc_option.bpf.o
bpf: $(BPF_OBJ)
$(BPF_OBJ): smcd_daemon/adapters/bpf/smc_option.bpf.c | deps
	@mkdir -p $(@D)
	clang -O2 -g -Wall -target bpf -I/usr/include/$$(uname -m)-linux-gnu -c $< -o $@

test: venv lint typecheck pytest

# The RDMA part alone: boots the Soft-RoCE VM (qemu/TCG, two rxe devices per host) once.
test-rdma: venv
	$(VPY) -m pytest tests/vm $(PYTEST_ARGS)

demo: venv
	$(VPY) -m smcd_daemon.demo

bench: venv
	$(VPY) bench/run.py

# A million hostile inputs through every decoder and a live daemon's handoff socket (make test
# runs 100,000): make fuzz FUZZ_COUNT=N.
FUZZ_COUNT ?= 1000000
fuzz: venv
	$(VPY) -m tests.fuzz.fuzz --count $(FUZZ_COUNT)

# The chaos test (#14) for SOAK_MINUTES: daemon killed, frozen, another uid flooding; a short
# version runs in make test (tests/soak/test_soak_short.py).
SOAK_MINUTES ?= 3
soak: venv
	$(VPY) -m tests.soak.soak --minutes $(SOAK_MINUTES)

# smcd SMC-R vs TCP vs the kernel's SMC-R inside the Soft-RoCE VM (bench/smcr_vm.py via the
# guest test test_smcr_bench, full volumes): one VM boot, then the table the guest wrote.
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

# -- install: smcd as a system service (README "Install") -----------------------------------------
# `make install` (as root) puts a venv with smcd and its PyPI dependencies in $(PREFIX)/lib/smcd
# (--system-site-packages: pyverbs and systemd-python come from Debian), links smcd, smcctl and
# smc-run into $(BINDIR), and installs the units, the D-Bus policy and activation file and
# /etc/smcd/smcd.toml (kept when it exists), and the peer-detection BPF object (make bpf) next to
# the module that loads it. The packages come from a wheelhouse built first
# ($(WHEELHOUSE), the only step that needs PyPI), so a machine that has one installs offline.
# DESTDIR stages everything under a directory (paths inside the files stay the real ones).
PREFIX ?= /usr
BINDIR ?= $(PREFIX)/bin
SMCD_LIBDIR = $(PREFIX)/lib/smcd
SYSCONFDIR ?= /etc
SYSTEMD_UNIT_DIR ?= /usr/lib/systemd/system
DBUS_DATA_DIR ?= /usr/share/dbus-1
WHEELHOUSE ?= .cache/wheels
WHEEL_BUILD_VENV := .cache/wheel-build
PKG_SOURCES := pyproject.toml $(shell find smcd_daemon smc_handoff -name '*.py' 2>/dev/null)
INSTALL_BINS := smcd smcctl smc-run
# Only a real install on a running systemd tells systemd and dbus-daemon to look again.
LIVE_SYSTEMD = test -z "$(DESTDIR)" && test -d /run/systemd/system

.PHONY: wheels install uninstall

wheels: $(WHEELHOUSE)/.complete

$(WHEELHOUSE)/.complete: $(PKG_SOURCES)
	@rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	@test -x $(WHEEL_BUILD_VENV)/bin/pip || $(PY) -m venv $(WHEEL_BUILD_VENV)
	$(WHEEL_BUILD_VENV)/bin/pip wheel -q --disable-pip-version-check --wheel-dir $(WHEELHOUSE) .
	@touch $@

install: wheels $(BPF_OBJ)
	@umask 022; set -e; \
	lib='$(DESTDIR)$(SMCD_LIBDIR)'; \
	$(PY) -m venv --clear --system-site-packages "$$lib"; \
	"$$lib/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
		--no-index --find-links '$(WHEELHOUSE)' smcd; \
	spec='import importlib.util as u; print(u.find_spec("smcd_daemon").submodule_search_locations[0])'; \
	install -m 0644 $(BPF_OBJ) "$$("$$lib/bin/python" -I -c "$$spec")/adapters/bpf/"; \
	if [ -n '$(DESTDIR)' ]; then \
		grep -rlI --null -F "$$lib" "$$lib/bin" "$$lib/pyvenv.cfg" | \
			xargs -0 -r sed -i "s|$$lib|$(SMCD_LIBDIR)|g"; \
	fi; \
	install -d '$(DESTDIR)$(BINDIR)'; \
	for b in $(INSTALL_BINS); do ln -sfn '$(SMCD_LIBDIR)'/bin/$$b '$(DESTDIR)$(BINDIR)'/$$b; done; \
	install -d '$(DESTDIR)$(SYSTEMD_UNIT_DIR)'; \
	sed 's|/usr/bin/smcd|$(BINDIR)/smcd|' units/smcd.service \
		> '$(DESTDIR)$(SYSTEMD_UNIT_DIR)/smcd.service'; \
	install -m 0644 units/smcd.socket '$(DESTDIR)$(SYSTEMD_UNIT_DIR)/smcd.socket'; \
	install -D -m 0644 config/dbus-1/system.d/org.smcd.conf \
		'$(DESTDIR)$(DBUS_DATA_DIR)/system.d/org.smcd.conf'; \
	install -D -m 0644 config/dbus-1/system-services/org.smcd.service \
		'$(DESTDIR)$(DBUS_DATA_DIR)/system-services/org.smcd.service'; \
	install -d '$(DESTDIR)$(SYSCONFDIR)/smcd'; \
	if [ -e '$(DESTDIR)$(SYSCONFDIR)/smcd/smcd.toml' ]; then \
		echo "keeping $(DESTDIR)$(SYSCONFDIR)/smcd/smcd.toml"; \
	else \
		install -m 0644 config/smcd.toml '$(DESTDIR)$(SYSCONFDIR)/smcd/smcd.toml'; \
	fi; \
	if $(LIVE_SYSTEMD); then \
		systemctl daemon-reload; \
		systemctl reload dbus.service 2>/dev/null || true; \
	fi; \
	echo "installed smcd in $(DESTDIR)$(SMCD_LIBDIR); enable it: systemctl enable smcd.service" \
		"&& systemctl start smcd.socket"

uninstall:
	@set -e; \
	if $(LIVE_SYSTEMD); then \
		systemctl disable --now smcd.socket smcd.service 2>/dev/null || true; \
	fi; \
	rm -rf '$(DESTDIR)$(SMCD_LIBDIR)'; \
	for b in $(INSTALL_BINS); do rm -f '$(DESTDIR)$(BINDIR)'/$$b; done; \
	rm -f '$(DESTDIR)$(SYSTEMD_UNIT_DIR)/smcd.service' '$(DESTDIR)$(SYSTEMD_UNIT_DIR)/smcd.socket' \
		'$(DESTDIR)$(DBUS_DATA_DIR)/system.d/org.smcd.conf' \
		'$(DESTDIR)$(DBUS_DATA_DIR)/system-services/org.smcd.service'; \
	conf='$(DESTDIR)$(SYSCONFDIR)/smcd/smcd.toml'; \
	if [ -e "$$conf" ] && ! cmp -s "$$conf" config/smcd.toml; then \
		echo "keeping $$conf (changed from the default; delete it by hand)"; \
	else \
		rm -f "$$conf"; rmdir '$(DESTDIR)$(SYSCONFDIR)/smcd' 2>/dev/null || true; \
	fi; \
	if $(LIVE_SYSTEMD); then \
		systemctl daemon-reload; \
		systemctl reload dbus.service 2>/dev/null || true; \
	fi
