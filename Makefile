# Tessera: build, test, run and install.
#
#   make run      tesserad on simulated GPUs (configs/dev.toml), in the foreground
#   make test     deps + fmt, clippy, buf + the whole test suite, Python client included (CI runs this as root);
#                 the hardware suites twice: on the simulator and on NVML over nvml-fake/ (make test-nvml)
#   make deps     the Debian packages the tests need, installed only when missing
#   make lint / fmt / build / bench / install / deb / image / clean
#   make buf      lint proto/ and check it for breaking changes (buf from npm, under the target dir)
#   make python   a venv with grpcio (pinned) and Python stubs generated from proto/

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build
MAKEFLAGS += --no-print-directory

CARGO ?= cargo
TARGET_DIR ?= $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
# Which build `make install` copies binaries from: dist (what `make build` makes: the
# release profile with fat LTO, Cargo.toml) or debug.
PROFILE ?= dist

# Install layout. DESTDIR stages a package root; PREFIX/BINDIR place the binaries.
DESTDIR ?=
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
CONFDIR ?= $(SYSCONFDIR)/tessera
UNITDIR ?= /lib/systemd/system
TMPFILESDIR ?= /usr/lib/tmpfiles.d
SYSUSERSDIR ?= /usr/lib/sysusers.d
APPARMORDIR ?= $(SYSCONFDIR)/apparmor.d
CONFIGS ?= configs

BINARIES := tesserad tessera tessera-runtime

# tessera-runtime ships statically linked (static-pie: glibc and libseccomp inside), as
# runc's own releases do: every container start execs it, and without the dynamic
# loader a start costs about half a millisecond less (docs/performance.md). It is built
# for an explicit --target so that crt-static reaches it and not the build scripts and
# proc-macros, and so lands in $(TARGET_DIR)/$(HOST_TRIPLE)/dist. RUNTIME_STATIC=0
# builds it like the other binaries.
RUNTIME_STATIC ?= 1
HOST_TRIPLE ?= $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
ifeq ($(RUNTIME_STATIC),1)
RUNTIME_DIST := $(TARGET_DIR)/$(HOST_TRIPLE)/dist/tessera-runtime
BUILD_BINS := tesserad tessera
else
RUNTIME_DIST := $(TARGET_DIR)/dist/tessera-runtime
BUILD_BINS := $(BINARIES)
endif
# The runtime `make install` copies.
RUNTIME_BIN := $(if $(filter dist,$(PROFILE)),$(RUNTIME_DIST),$(TARGET_DIR)/$(PROFILE)/tessera-runtime)
# libseccomp-sys links libseccomp.a (libseccomp-dev) from the directory pkg-config names.
STATIC_RUNTIME_BUILD = LIBSECCOMP_LINK_TYPE=static \
	LIBSECCOMP_LIB_PATH="$$(pkg-config --variable=libdir libseccomp)" \
	$(CARGO) build --profile dist --target $(HOST_TRIPLE) \
	--config 'target.$(HOST_TRIPLE).rustflags = ["-C", "target-feature=+crt-static"]' \
	-p tessera-runtime --bin tessera-runtime
# `make bench`: figures go to BENCH_RESULTS, and one table of them against the goals
# (docs/performance.md) ends the output. Durations are modest for a shared machine.
BENCH_RESULTS ?= $(TARGET_DIR)/bench-results.txt
BENCH_PREFILL ?= 20000
TESSERA_BENCH_ARGS ?= --seconds 5 --clients 1,8,32 --prefill $(BENCH_PREFILL) --curve-seconds 3
# runtime-bench needs root, runc and busybox; its bundles go on tmpfs as containerd's
# do (/run), here /dev/shm.
RUNTIME_BENCH_ARGS ?= --iterations 300 --sim-lease --workdir /dev/shm
# placement-bench: 3 mixes x 3 loads (0.8, 1.0, 1.3) x 2 duration laws x 3 seeds on 8 simulated H100s,
# TTLs upper bounds of the durations (--ttl upper, its default); drop --quiet to see
# every trace.
PLACEMENT_BENCH_ARGS ?= --quiet

PYTHON ?= python3

# Packages the test suite needs: "package:probe", probe = a command that proves it is
# there, or "-" to ask dpkg. python3-venv is added when $(PYTHON) cannot make a venv
# (Debian's python3 lacks ensurepip without it); npm installs buf. The CRI suite's pods
# get a CNI bridge without uplink (containernetworking-plugins; iproute2's `ip` removes
# it afterwards); the podman suite runs Debian's podman 4 and conmon; promtool (from
# Debian's prometheus package, whose server is stopped again if its install started
# it) tests the alert rules in deploy/monitoring; lintian checks the Debian package.
DEPS := runc:runc containerd:containerd busybox-static:- libseccomp-dev:- \
        protobuf-compiler:protoc pkg-config:pkg-config build-essential:cc \
        python3:$(PYTHON) npm:npm containernetworking-plugins:- iproute2:ip \
        podman:podman conmon:conmon prometheus:promtool lintian:lintian

# Python for the grpcio client test (integration-tests/tests/python_client.rs) and
# docs/examples/python: a venv this Makefile owns, with the pinned requirements.
PYVENV ?= $(TARGET_DIR)/pyvenv
PYREQ := integration-tests/python/requirements.txt
# Python stubs generated from proto/ (never committed).
PYGEN ?= $(TARGET_DIR)/pygen

# buf (https://buf.build): proto lint and breaking-change checks, installed from npm
# into a folder this Makefile owns. `make buf` compares proto/ with its state at
# BUF_AGAINST (a git revision; the previous commit unless told otherwise).
BUF_VERSION ?= 1.75.0
BUF_DIR ?= $(TARGET_DIR)/buf
BUF := $(BUF_DIR)/node_modules/.bin/buf
BUF_AGAINST ?= HEAD~1

.PHONY: all run deps test lint fmt build bench install deb image clean help buf buf-install pyvenv python static-runtime-test test-nvml

all: build

help:
	@sed -n '3,9p' $(firstword $(MAKEFILE_LIST))

run:
	$(CARGO) build --bin tesserad --bin tessera
	mkdir -p run
	@echo
	@echo "tesserad starts in the foreground (Ctrl-C stops it). In another shell:"
	@echo "  export TESSERA_SOCKET=$(CURDIR)/run/tesserad.sock; $(abspath $(TARGET_DIR))/debug/tessera gpus"
	@echo
	exec $(TARGET_DIR)/debug/tesserad --config configs/dev.toml

deps:
	@missing=(); \
	for entry in $(DEPS); do \
	  pkg=$${entry%%:*}; probe=$${entry#*:}; \
	  if [ "$$probe" != "-" ] && command -v "$$probe" >/dev/null 2>&1; then continue; fi; \
	  if dpkg-query -W -f='$${Status}' "$$pkg" 2>/dev/null | grep -q 'install ok installed'; then continue; fi; \
	  missing+=("$$pkg"); \
	done; \
	if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then missing+=(python3-venv); fi; \
	if [ $${#missing[@]} -eq 0 ]; then \
	  echo "deps: all system packages present, nothing to install"; \
	else \
	  echo "deps: installing $${missing[*]}"; \
	  if [ "$$(id -u)" -eq 0 ]; then sudo=(); \
	  elif command -v sudo >/dev/null 2>&1; then sudo=(sudo); \
	  else echo "deps: missing $${missing[*]} and not root (no sudo): install them first" >&2; exit 1; fi; \
	  "$${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q; \
	  "$${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$${missing[@]}"; \
	  if [[ " $${missing[*]} " == *" prometheus "* ]] && pgrep -x prometheus >/dev/null; then \
	    echo "deps: stopping the prometheus server its package started (only promtool is needed)"; \
	    "$${sudo[@]}" sh -c 'invoke-rc.d prometheus stop || pkill -x prometheus' || true; \
	  fi; \
	fi; \
	for tool in clippy fmt; do \
	  if $(CARGO) $$tool --version >/dev/null 2>&1; then continue; fi; \
	  comp=$$tool; [ "$$tool" = fmt ] && comp=rustfmt; \
	  if command -v rustup >/dev/null 2>&1; then \
	    echo "deps: rustup component add $$comp"; rustup component add "$$comp"; \
	  else \
	    echo "deps: cargo $$tool is missing and rustup is absent: install $$comp yourself" >&2; \
	  fi; \
	done

# The suites that exercise the hardware interface (MIG 1g..7g, MIG+MPS, release,
# restart reconcile, health, crash mid-create, faults, topology): `make test` runs them
# on the simulator with the rest, then again on the NVML backend over the fake
# libnvidia-ml that nvml-fake/ builds (TESSERA_TEST_BACKEND=nvml).
HARDWARE_SUITES := --test daemon --test crash --test health --test faults --test placement \
	--test multi_gpu --test mps_modes --test need --test topology

# The hardware suites alone on the NVML backend over the fake.
test-nvml:
	$(CARGO) build --workspace --bins
	$(CARGO) build -p nvml-fake --lib
	TESSERA_TEST_BACKEND=nvml $(CARGO) test -p tessera-integration-tests $(HARDWARE_SUITES)

# Each stage says what it runs; the first failure stops the run and names its stage.
test: deps
	@stage() { name=$$1; shift; echo "==> make test: $$name: $$*"; \
	  if ! "$$@"; then echo "==> make test: stage '$$name' FAILED" >&2; exit 1; fi; }; \
	stage fmt $(CARGO) fmt --all -- --check; \
	stage clippy $(CARGO) clippy --workspace --all-targets -- -D warnings; \
	stage buf $(MAKE) buf; \
	stage python $(MAKE) python; \
	stage build $(CARGO) build --workspace --bins; \
	stage fake-nvml $(CARGO) build -p nvml-fake --lib; \
	stage test env TESSERA_PYTHON="$(abspath $(PYVENV))/bin/python" TESSERA_REQUIRE_PYTHON=1 \
	  $(CARGO) test --workspace; \
	stage test-nvml env TESSERA_TEST_BACKEND=nvml \
	  $(CARGO) test -p tessera-integration-tests $(HARDWARE_SUITES); \
	if [ "$(RUNTIME_STATIC)" = 1 ]; then stage static-runtime $(MAKE) static-runtime-test; fi; \
	echo "==> make test: all stages passed"

# The runtime as `make build` ships it: built statically, checked to have no program
# interpreter, then the suites that run it for real (runc, passthrough, allowlist,
# identity, redteam1) run again on it.
static-runtime-test:
	$(STATIC_RUNTIME_BUILD)
	@if readelf -l "$(RUNTIME_DIST)" | grep -q 'program interpreter'; then \
	  echo "static-runtime-test: $(RUNTIME_DIST) is dynamically linked" >&2; exit 1; fi
	TESSERA_TEST_RUNTIME="$(abspath $(RUNTIME_DIST))" \
	  $(CARGO) test -p tessera-runtime --test runc --test passthrough --test allowlist --test identity --test redteam1

# The venv is rebuilt when the requirements change.
$(PYVENV)/.installed: $(PYREQ)
	rm -rf "$(PYVENV)"
	$(PYTHON) -m venv "$(PYVENV)"
	"$(PYVENV)/bin/python" -m pip install --quiet --disable-pip-version-check -r $(PYREQ)
	touch "$@"

pyvenv: $(PYVENV)/.installed

python: pyvenv
	rm -rf "$(PYGEN)"
	mkdir -p "$(PYGEN)"
	"$(PYVENV)/bin/python" -m grpc_tools.protoc -Iproto --python_out="$(PYGEN)" \
	  --grpc_python_out="$(PYGEN)" --pyi_out="$(PYGEN)" tessera/v1/tessera.proto
	@echo "python: stubs in $(PYGEN); try docs/examples/python/tessera_client.py:"
	@echo "  PYTHONPATH=$(abspath $(PYGEN)) $(abspath $(PYVENV))/bin/python docs/examples/python/tessera_client.py --socket $(CURDIR)/run/tesserad.sock"

$(BUF_DIR)/.installed-$(BUF_VERSION):
	rm -rf "$(BUF_DIR)"
	mkdir -p "$(BUF_DIR)"
	npm install --prefix "$(BUF_DIR)" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$(BUF_VERSION)"
	touch "$@"

buf-install: $(BUF_DIR)/.installed-$(BUF_VERSION)

# Lint, then the breaking-change check against BUF_AGAINST (FILE rules: wire format
# and generated code). A clone without that revision (shallow) says SKIPPED.
buf: buf-install
	cd proto && "$(abspath $(BUF))" lint
	@if git rev-parse --verify -q "$(BUF_AGAINST)^{commit}" >/dev/null; then \
	  echo "buf breaking: proto/ against $(BUF_AGAINST)"; \
	  cd proto && "$(abspath $(BUF))" breaking --against "$$(git rev-parse --show-toplevel)/.git#ref=$$(git rev-parse "$(BUF_AGAINST)^{commit}"),subdir=proto"; \
	else \
	  echo "buf breaking: SKIPPED: no revision $(BUF_AGAINST) in this clone (BUF_AGAINST=...)"; \
	fi

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build --profile dist $(addprefix --bin ,$(BUILD_BINS))
ifeq ($(RUNTIME_STATIC),1)
	$(STATIC_RUNTIME_BUILD)
endif

# The daemon and the runtime as `make build` ships them (the dist profile), the benchmark
# tools (the tessera-bench crate, bench/) in release; then tessera-bench
# (throughput at 1/8/32 clients, the scale curve up to BENCH_PREFILL live leases, RSS,
# restart), runtime-bench (the lease path against hardened runc) and placement-bench (MIG
# placement against a free-repacking reference on request traces). Every bench runs
# even when an earlier one fails; the goals table comes last (a goal a failed bench
# could not measure says so), and the target fails if a bench did.
bench:
	$(CARGO) build --profile dist --bin tesserad $(if $(filter 1,$(RUNTIME_STATIC)),,--bin tessera-runtime)
	$(CARGO) build --release -p tessera-bench --bins
ifeq ($(RUNTIME_STATIC),1)
	$(STATIC_RUNTIME_BUILD)
endif
	@rm -f "$(BENCH_RESULTS)"; failed=(); \
	echo "==> bench: tessera-bench $(TESSERA_BENCH_ARGS)"; \
	$(TARGET_DIR)/release/tessera-bench --tesserad $(TARGET_DIR)/dist/tesserad $(TESSERA_BENCH_ARGS) --results "$(BENCH_RESULTS)" || failed+=(tessera-bench); \
	echo; echo "==> bench: runtime-bench $(RUNTIME_BENCH_ARGS)"; \
	$(TARGET_DIR)/release/runtime-bench --runtime "$(RUNTIME_DIST)" --tesserad $(TARGET_DIR)/dist/tesserad $(RUNTIME_BENCH_ARGS) --results "$(BENCH_RESULTS)" || failed+=(runtime-bench); \
	echo; echo "==> bench: placement-bench $(PLACEMENT_BENCH_ARGS)"; \
	$(TARGET_DIR)/release/placement-bench $(PLACEMENT_BENCH_ARGS) --results "$(BENCH_RESULTS)" || failed+=(placement-bench); \
	touch "$(BENCH_RESULTS)"; \
	$(TARGET_DIR)/release/tessera-bench report "$(BENCH_RESULTS)"; \
	if [ $${#failed[@]} -ne 0 ]; then echo "==> bench: FAILED: $${failed[*]}" >&2; exit 1; fi

# Installs what `make build` built (PROFILE=debug for a debug build). Configs already
# present under $(CONFDIR) are never overwritten: the new version lands next to them
# as NAME.example. AppArmor profiles that exist are left alone too; their new version
# goes to $(CONFDIR)/apparmor/NAME.example (never into apparmor.d, which would load it).
install:
	@for b in $(addprefix $(TARGET_DIR)/$(PROFILE)/,tesserad tessera) $(RUNTIME_BIN); do \
	  if [ ! -x "$$b" ]; then \
	    echo "install: $$b is missing: run 'make build' first (or PROFILE=debug)" >&2; exit 1; fi; \
	done; \
	if [ ! -f "$(CONFIGS)/tesserad.toml" ]; then echo "install: $(CONFIGS)/tesserad.toml is missing" >&2; exit 1; fi
	install -d -m 0755 "$(DESTDIR)$(BINDIR)"
	install -m 0755 $(addprefix $(TARGET_DIR)/$(PROFILE)/,tesserad tessera) $(RUNTIME_BIN) "$(DESTDIR)$(BINDIR)/"
	install -d -m 0755 "$(DESTDIR)$(UNITDIR)"
	sed 's|/usr/local/bin/|$(BINDIR)/|g; s|/etc/tessera/|$(CONFDIR)/|g' systemd/tesserad.service \
	  > "$(DESTDIR)$(UNITDIR)/tesserad.service"
	chmod 0644 "$(DESTDIR)$(UNITDIR)/tesserad.service"
	install -D -m 0644 systemd/tessera.tmpfiles.conf "$(DESTDIR)$(TMPFILESDIR)/tessera.conf"
	install -D -m 0644 systemd/tessera.sysusers.conf "$(DESTDIR)$(SYSUSERSDIR)/tessera.conf"
	@conf() { src=$$1; dst=$$2; \
	  if [ -e "$$dst" ]; then install -D -m 0644 "$$src" "$$dst.example"; \
	    echo "install: kept existing $$dst; new version is $$dst.example"; \
	  else install -D -m 0644 "$$src" "$$dst"; echo "install: $$dst"; fi; }; \
	conf $(CONFIGS)/tesserad.toml "$(DESTDIR)$(CONFDIR)/tesserad.toml"; \
	if [ -f $(CONFIGS)/runtime.toml ]; then conf $(CONFIGS)/runtime.toml "$(DESTDIR)$(CONFDIR)/runtime.toml"; \
	else echo "install: WARNING: no $(CONFIGS)/runtime.toml (tessera-runtime's config)" >&2; fi; \
	install -d -m 0755 "$(DESTDIR)$(CONFDIR)/seccomp"; \
	found=0; \
	for f in $(CONFIGS)/seccomp/*; do [ -f "$$f" ] || continue; found=1; \
	  conf "$$f" "$(DESTDIR)$(CONFDIR)/seccomp/$$(basename "$$f")"; done; \
	[ $$found = 1 ] || echo "install: WARNING: no seccomp profiles under $(CONFIGS)/seccomp" >&2; \
	install -d -m 0755 "$(DESTDIR)$(APPARMORDIR)"; \
	found=0; \
	for f in $(CONFIGS)/apparmor/*; do [ -f "$$f" ] || continue; found=1; \
	  name=$$(basename "$$f"); dst="$(DESTDIR)$(APPARMORDIR)/$$name"; \
	  if [ -e "$$dst" ]; then \
	    install -D -m 0644 "$$f" "$(DESTDIR)$(CONFDIR)/apparmor/$$name.example"; \
	    echo "install: kept existing $$dst; new version is $(DESTDIR)$(CONFDIR)/apparmor/$$name.example"; \
	  else install -m 0644 "$$f" "$$dst"; echo "install: $$dst"; fi; \
	done; \
	[ $$found = 1 ] || echo "install: WARNING: no AppArmor profiles under $(CONFIGS)/apparmor" >&2
	@echo "install: done. Then: systemd-sysusers; systemd-tmpfiles --create; systemctl daemon-reload; systemctl enable --now tesserad"

# The Debian package, from the binaries of PROFILE (`make build` first for dist):
# $(TARGET_DIR)/deb/tessera_<version>_<arch>.deb. See deploy/debian/build-deb.sh.
deb:
	@if [ "$(PROFILE)" = dist ]; then $(MAKE) build; fi
	deploy/debian/build-deb.sh --profile $(PROFILE) --out $(TARGET_DIR)/deb

# The DaemonSet's image, built with podman from the binaries of PROFILE on a scratch
# base (no registry): tessera:<version>. deploy/image/stage-rootfs.sh stages it; the
# registry-based deploy/kubernetes/Dockerfile uses the same script.
IMAGE ?= localhost/tessera:$(shell sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
image:
	@if [ "$(PROFILE)" = dist ]; then $(MAKE) build; fi
	deploy/image/stage-rootfs.sh $(TARGET_DIR)/$(PROFILE) $(RUNTIME_BIN) $(TARGET_DIR)/image-rootfs
	podman build --network none -f deploy/image/Containerfile -t $(IMAGE) $(TARGET_DIR)/image-rootfs
	@podman image inspect --format '$(IMAGE): {{.Size}} bytes' $(IMAGE)

clean:
	$(CARGO) clean
	rm -rf run
