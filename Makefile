# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# torch is pinned here, first, to the CPU build that lies on disk; the
# project itself only asks for a range (torch>=2.6).
#
#   demo: mlacore and its CLI (torch, pydantic, pluggy, rich, tomlkit): seconds
#   test: also the test tools, the FlashInfer, CUTLASS and CuTe DSL plugins and the
#         library releases they were verified (or, for the SM100 paths, written)
#         with, so that their host tests (and the kernels' sm_90a compile tests)
#         run on CPU (CI)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# the FlashInfer release the plugin was verified with on the H200
FLASHINFER_PIN ?= flashinfer-python==0.7.2.post1
# the CuTe DSL release our kernels were compiled and checked with
CUTE_DSL_PIN ?= nvidia-cutlass-dsl==4.8.1

.PHONY: demo test clean

$(VENV)/.demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[cli]'
	touch $@

$(VENV)/.test: $(VENV)/.demo pyproject.toml plugins/flashinfer_mla/pyproject.toml plugins/cutlass_mla/pyproject.toml \
		plugins/cute_dsl_mla/pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q -e plugins/flashinfer_mla $(FLASHINFER_PIN)
	$(PY) -m pip install -q -e plugins/cutlass_mla $(FLASHINFER_PIN)
	$(PY) -m pip install -q -e plugins/cute_dsl_mla $(CUTE_DSL_PIN)
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/mla backends list
	$(VENV)/bin/mla check --quick --device cpu

test: $(VENV)/.test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
