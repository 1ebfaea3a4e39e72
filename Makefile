# fedlt: the two commands of the README, and their set-up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
DEMO_EXTRAS ?= report
TEST_EXTRAS ?= test,report,flower,docs,ray,simulation,mlflow,wandb,tensorboard,flwr-datasets,privacy,pretrained
DOCS_EXTRAS ?= docs
SUDO    := $(shell [ "$$(id -u)" = "0" ] || echo sudo)
FMNIST  := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: demo test setup data docs docs-serve clean

# A venv with the CPU build of torch (pip takes the local 2.13.0 wheel where one is provided) and fedlt.
# The stamp names the extras installed: report (figures), flower (the Flower engine), test (pytest), docs (MkDocs).
$(BIN)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[$*]"
	touch $@

setup: $(BIN)/.installed-$(DEMO_EXTRAS)

# Fashion-MNIST from Debian's package, where apt exists and the files are not there yet.
data:
	@if [ ! -f $(FMNIST) ] && [ -z "$$FEDLT_DATA" ] && command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist; fi

# A short federated long-tailed run: Fashion-MNIST-LT (rho 100), Dirichlet 0.5 over 20 clients. One torch
# thread: with two, a second busy process on a 2-core machine made rounds 25x slower (OpenMP waits).
demo: $(BIN)/.installed-$(DEMO_EXTRAS) data
	$(BIN)/fedlt run --method fedloge --rounds 10 --eval-every 5 --threads 1 --out runs/demo

# The suite in two pytest-xdist processes, one per core of a 2-core machine (there: 673 s, where one process took
# 900 s): a file's tests stay in one process (module fixtures, background deployments), and the files that take
# longest start first (tests/conftest.py FIRST; xdist's own order, by number of tests, is turned off). It ends with
# the ten slowest tests, so a change that slows the suite shows where.
test: $(BIN)/.installed-$(TEST_EXTRAS)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10

# The documentation site (mkdocs.yml; docs/gen_reference.py writes the method and API references from the code):
# built into site/, failing on any warning (a broken link, a page missing from the navigation); or served with
# live reload on http://127.0.0.1:8000.
docs: $(BIN)/.installed-$(DOCS_EXTRAS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(BIN)/.installed-$(DOCS_EXTRAS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs build site src/*.egg-info
