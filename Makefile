# Two commands do all the set-up: `make demo` and `make test`.
# The virtual environment is made on first use. torch is pinned to 2.13.0
# first so that pip takes the CPU build this machine provides; pyproject.toml
# asks for the range the tests cover (set TORCH= to choose another build in it).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtlab-installed

.PHONY: demo test test-fast lint bench figures lab book clean

$(STAMP): pyproject.toml
	@echo "dtlab: installing torch and the other dependencies into $(VENV) (once; a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[notebook,dev]"
	touch $(STAMP)

# The comparison shows every tier slower than one process on a width-64 MLP (communication-bound); the sweep after
# it measures where ddp at world size 2 starts to beat one process as the model grows (crossover.csv, crossover.png).
demo: $(STAMP)
	@echo "dtlab: comparing five tiers at world size 2 on one job, then sweeping the model width (a few minutes)"
	$(PY) -m dtlab compare --tiers single,dp,ddp-naive,ddp,zero --world-sizes 2 --steps 60 --out results/demo
	$(PY) -m dtlab.experiments.speedup --out results/demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=10

# The quick inner loop: no process launches, notebooks or browser (under 2 minutes).
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow"

# The course in JupyterLab, on loopback; it prints the URL to open (start at 00_overview.ipynb).
# LAB_FLAGS passes more options to JupyterLab, e.g. LAB_FLAGS="--port=8899 --no-browser".
LAB_FLAGS ?=
lab: $(STAMP)
	@echo "dtlab: opening JupyterLab on notebooks/; open the URL below and start at 00_overview.ipynb"
	$(PY) -m jupyterlab --ServerApp.root_dir=notebooks --ServerApp.ip=127.0.0.1 \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS)

# The course as a static site (build/book/index.html), offline: notebooks executed in quick mode (the
# executions `make test` left in build/executed/ are reused while current), plus the docs pages.
book: $(STAMP)
	$(PY) -m dtlab.app.book --out build/book

bench: $(STAMP)
	$(PY) -m dtlab bench --out results/bench --docs

# Every figure the README and docs/ show, made again from the current code and copied into docs/figures/
# (the table of figures and their commands: dtlab/app/figures.py; `python -m dtlab.app.figures --only NAME,...`
# makes some of them).
figures: $(STAMP)
	$(PY) -m dtlab.app.figures

clean:
	rm -rf results build .pytest_cache
