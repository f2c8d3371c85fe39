# faceops: `make run` sets up and runs the pipeline on the embedded default; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.faceops-installed
PLOTS_TEMPLATE := .dvc/plots-offline.html
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export MLFLOW_DISABLE_TELEMETRY := true
export GX_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export DO_NOT_TRACK := 1

.PHONY: setup run test smoke bench clean

# torch first, through pip so the machine's pip configuration picks the wheel (the CPU build where one is
# offered); then the pinned stack through uv, which resolves the same versions as pip in seconds, not minutes.
# uv does not read pip's configuration: a PIP_INDEX_URL in the environment is handed on to it.
# Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE is set, nothing would ever write it, and every
# stage process (and every `dvc` call) would compile torch, Lightning, MLflow and Prefect from source again.
# pip's own compile runs on one core; compileall -j 0 does torch and its dependencies on every core instead (a few
# files written for newer Pythons do not compile, as under pip: they are skipped), uv the rest.
ifdef PIP_INDEX_URL
export UV_DEFAULT_INDEX ?= $(PIP_INDEX_URL)
endif

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile torch==2.13.0 uv==0.13.8
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	  > /dev/null 2>&1 || true
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[test,reference]'
	@touch $(STAMP)

# the page template .dvc/config names for `dvc plots show`: Vega inline from the installed vl-convert, no CDN
$(PLOTS_TEMPLATE): $(STAMP)
	$(BIN)/python -m faceops.plots

setup: $(STAMP) $(PLOTS_TEMPLATE)

run: setup
	$(BIN)/faceops run

smoke: setup
	$(BIN)/faceops run --preset smoke

# the tests run on two pytest-xdist workers, a file per worker at a time (a module's fixtures are built once);
# the browser tests (tests/browser) drive the system's Chromium: where it is missing and apt-get exists, Debian's
# package is installed (as root, or through a password-less sudo); if that fails they are skipped, saying why
test: setup
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
	  apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -q=2"; \
	  echo "installing chromium with apt-get for the browser tests"; \
	  $$apt install -y chromium >/dev/null \
	    || { $$apt update >/dev/null && $$apt install -y chromium >/dev/null; } \
	    || echo "chromium could not be installed: the browser tests will be skipped"; \
	fi
	$(BIN)/python -m pytest -n 2 --dist loadfile

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf data/prepared models metrics plots reports/validation reports/validation-failed mlflow.db .dvc/cache .dvc/tmp
