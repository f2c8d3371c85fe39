# faceops: `make run` sets up and runs the pipeline on the embedded default; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.faceops-installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export MLFLOW_DISABLE_TELEMETRY := true
export GX_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export DO_NOT_TRACK := 1

.PHONY: setup run test smoke bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/faceops run

smoke: setup
	$(BIN)/faceops run --preset smoke

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf data/prepared models metrics plots reports/validation reports/validation-failed mlflow.db .dvc/cache .dvc/tmp
