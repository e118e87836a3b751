# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# torch is pinned here, first, to the CPU build that lies on disk; the
# project itself only asks for a range (torch>=2.6).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# the FlashInfer release the plugin was verified with on the H200
FLASHINFER_PIN ?= flashinfer-python==0.7.2.post1

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q "setuptools>=64" -e '.[test]'
	$(PY) -m pip install -q -e plugins/flashinfer_mla $(FLASHINFER_PIN)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/mla backends list
	$(VENV)/bin/mla check --quick --device cpu

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
