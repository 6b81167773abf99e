# `make run` and `make test` set themselves up on a fresh machine (venv + packages), then do their job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the CPU build on this machine's disk; pyproject.toml bounds torch, this pins it
TORCH := 2.13.0
# DeepSpeed for the tests of DeepSpeed stages on CPU processes (tests/e2e/test_deepspeed.py): built
# against the torch above (no build isolation, which would fetch another torch) with no compiled ops,
# into a folder of its own that only that test puts on the path (imported anywhere, DeepSpeed warns
# on every CPU run that it found no GPU)
DEEPSPEED := 0.19.8

export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := False
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test bench gpu-check clean sandbox-tools browser-tools

setup: $(STAMP) sandbox-tools

# The agentic envs run every command of the policy in bubblewrap, under a seccomp filter built with
# libseccomp; there is no unsandboxed fallback. Installed here where root and apt can; elsewhere
# install the Debian/Ubuntu packages bubblewrap and libseccomp2.
SANDBOX_READY = command -v bwrap >/dev/null && /sbin/ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2 '
sandbox-tools:
	@$(SANDBOX_READY) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq bubblewrap libseccomp2 >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null 2>&1; }; }; } || true
	@$(SANDBOX_READY) || echo "warning: bwrap or libseccomp2 not found; install bubblewrap and libseccomp2 to use the terminal, rlm and openclaw envs" >&2

# The browser test of the Prefect UI's report images (tests/e2e/test_report_ui.py) drives headless
# Chromium through chromedriver. `make test` installs them where root and apt can (~15-20 s; not
# `make run`, which needs no browser); elsewhere install the Debian packages chromium and
# chromium-driver, or the test skips.
BROWSER_READY = command -v chromium >/dev/null && command -v chromedriver >/dev/null
BROWSER_PACKAGES = DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1
browser-tools:
	@$(BROWSER_READY) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  { $(BROWSER_PACKAGES) || { apt-get update -qq >/dev/null 2>&1 && $(BROWSER_PACKAGES); }; }; } || true
	@$(BROWSER_READY) || echo "warning: chromium or chromedriver not found; install chromium and chromium-driver to run the browser test of the Prefect UI" >&2

# torch first and pinned, so pip keeps the CPU build that lies on this machine's disk.
# pip byte-compiles what it installs (most of a fresh set-up's ~4 minutes): keep it, since this
# machine sets PYTHONDONTWRITEBYTECODE=1 and without those .pyc files every process would compile
# torch and transformers from source at each import (a trial with --no-compile ran far slower).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation --no-deps --target $(VENV)/deepspeed \
	    deepspeed==$(DEEPSPEED) einops hjson msgpack ninja py-cpuinfo
	touch $(STAMP)

run: setup
	$(BIN)/posttrain run pipelines/quickstart.yaml

# The project's own packages byte-compiled once, as pip did site-packages: with
# PYTHONDONTWRITEBYTECODE=1 (this machine) every process the tests start (each `posttrain` command,
# fork server, worker flow run) would compile the modules it imports from source again (~1 s of CPU
# for a stage process's imports). A stale .pyc is only ignored: Python checks the source's mtime.
PACKAGES := artifacts bench data_contracts envs flows models tasks

# Two pytest-xdist workers, each on its own core (tests/conftest.py): much of the suite waits on
# servers and subprocesses, so on 2 cores the suite took 14½ minutes on two workers and 28 on one.
TEST_WORKERS ?= 2

test: setup browser-tools
	$(BIN)/python -m compileall -q $(PACKAGES) || true
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadgroup

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench $(NAME)

# every stage kind on CUDA (a GPU machine; refuses elsewhere): bench/results/gpu_check.json
# (on a GPU box, install torch's CUDA build in .venv first: docs/GPU.md "Running on a GPU cluster")
gpu-check: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.gpu_check

clean:
	rm -rf .posttrain
