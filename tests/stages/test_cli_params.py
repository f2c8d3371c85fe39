"""`faceops run --set`: the delta edits only its keys' lines, paths are checked before anything starts, and a run that
fails puts params.yaml back byte for byte."""

from __future__ import annotations

import logging
import time

import pytest
from typer.testing import CliRunner

from ml.errors import ConfigError
from tasks.common import load_yaml
from tasks.params import INPUT_PATHS, ParamsUndo, apply_delta, check_input_paths, set_key

from tests.conftest import REPO, copy_project
from tests.stages.test_cli import _run


@pytest.fixture
def workspace(tmp_path):
    return copy_project(tmp_path / "ws")


# ------------------------------------------------------------------------------------------ the rewrite itself

def test_delta_changes_only_the_lines_of_its_keys(tmp_path):
    params = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_bytes()
    params.write_bytes(original)
    changes = apply_delta(params, {"fr.epochs": 2, "synthesize.sampler.hard_switch_t": 500,
                                   "evaluate.fars": [0.01], "data.procedural.blur_prob": 0.3})
    assert changes["fr.epochs"] == (12, 2) and changes["synthesize.sampler.hard_switch_t"] == (None, 500)
    before, after = original.split(b"\n"), params.read_bytes().split(b"\n")
    assert len(before) == len(after)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert [after[i].split(b"#")[0].strip() for i in changed] == [
        b"procedural: {blur_prob: 0.3}", b"epochs: 2", b"hard_switch_t: 500", b"fars: [0.01]"]
    for i in changed:  # each keeps its comment, at its column while the new value fits before it
        if b"#" in before[i]:
            comment = before[i][before[i].index(b"#"):]
            assert after[i].endswith(comment)
            if len(after[i].split(b"#")[0].rstrip()) < before[i].index(b"#"):
                assert after[i].index(b"#") == before[i].index(b"#")
    nulls = [i for i, line in enumerate(before) if b": null" in line and i not in changed]
    assert nulls and all(after[i] == before[i] for i in nulls)  # untouched nulls stay `null`, not empty


def test_set_key_keeps_nulls_comments_quotes_and_crlf():
    text = ("# head\r\n"
            "a:              # section a\r\n"
            "  x: null       # stays null\r\n"
            "  y: 'quoted'   # stays quoted\r\n"
            "  z: ~\r\n"
            "  n: 1          # one\r\n"
            "  block:        # replaced by a flow mapping\r\n"
            "    p: 1\r\n"
            "    q: [1,\r\n"
            "        2]\r\n"
            "  empty:\r\n"
            "  # the last comment of a\r\n"
            "b: {}\r\n")
    out = set_key(text, "a.n", 22)
    assert out == text.replace("  n: 1          # one", "  n: 22         # one")
    out = set_key(out, "a.block", {"p": 2})
    assert "  block: {p: 2} # replaced by a flow mapping\r\n  empty:\r\n" in out and "q: [1" not in out
    out = set_key(out, "a.empty", "")
    assert "  empty: ''\r\n  # the last comment of a\r\n" in out
    out = set_key(out, "a.new", [1, 2])  # a missing key: the mapping's last line, at its indentation
    assert "  empty: ''\r\n  new: [1, 2]\r\n  # the last comment of a\r\n" in out
    out = set_key(out, "b.c.d", None)  # below a flow mapping: merged into it
    assert out.endswith("b: {c: {d: null}}\r\n")
    for line in ("# head", "  x: null       # stays null", "  y: 'quoted'   # stays quoted", "  z: ~"):
        assert f"{line}\r\n" in out
    assert load_yaml(out) == {"a": {"x": None, "y": "quoted", "z": None, "n": 22, "block": {"p": 2}, "empty": "",
                                    "new": [1, 2]}, "b": {"c": {"d": None}}}
    with pytest.raises(ConfigError, match="'a.n' is not a section; cannot set 'a.n.m'"):
        set_key(out, "a.n.m", 1)


# ----------------------------------------------------------------------------------------------- input paths

@pytest.mark.parametrize("key", sorted(INPUT_PATHS))
def test_missing_input_path_is_refused_naming_key_and_path_without_writing(tmp_path, key):
    params = tmp_path / "params.yaml"
    params.write_bytes((REPO / "params.yaml").read_bytes())
    before = params.read_bytes()
    with pytest.raises(ConfigError, match=rf"^{key}: /no/such/path is not a (directory|file); point it at .*, or "
                                          rf"set {key}=(\"\"|null) to turn it off$"):
        apply_delta(params, {key: "/no/such/path"})
    assert params.read_bytes() == before
    assert list(tmp_path.iterdir()) == [params]


def test_input_paths_resolve_from_the_repository_root(tmp_path):
    (tmp_path / "faces").mkdir()
    (tmp_path / "train.rec").write_bytes(b"")
    check_input_paths({"data": {"ingest_folder": "faces", "ingest_recordio": str(tmp_path / "train.rec")},
                       "generator": {"autoencoder": None}, "evaluate": {"bin_dir": ""}}, tmp_path)
    with pytest.raises(ConfigError, match=r"input paths not found:\n  data.ingest_folder: faces2 \(relative to .*\) "
                                          r"is not a directory.*\n  evaluate.bin_dir: bins \(relative to"):
        check_input_paths({"data": {"ingest_folder": "faces2"}, "evaluate": {"bin_dir": "bins"}}, tmp_path)


def test_bad_path_is_refused_before_anything_starts(workspace):
    before = (workspace / "params.yaml").read_bytes()
    start = time.monotonic()
    out = _run(["run", "--set", "fr.epochs=3", "--set", "data.ingest_folder=/no/such/dir"], workspace,
               MLFLOW_TRACKING_URI=f"sqlite:///{workspace / 'mlflow.db'}")
    assert out.returncode == 2, out.stderr
    assert time.monotonic() - start < 30  # the flow's temporary Prefect server alone takes longer to start
    assert out.stderr.count("data.ingest_folder: /no/such/dir is not a directory; point it at an image folder") == 1
    assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout  # one error and nothing else
    assert (workspace / "params.yaml").read_bytes() == before
    assert not (workspace / "mlflow.db").exists() and not (workspace / "data").exists()


# ------------------------------------------------------------------------------------------ restore on failure

def _invoke_run(workspace, monkeypatch, args, outcome):
    """``faceops run ARGS`` in this process with the flow replaced by ``outcome()``; → (result, params.yaml as the
    flow saw it)."""
    import flows.pipeline
    from faceops.cli import app

    seen = []

    def run_pipeline(**kwargs):
        seen.append((workspace / "params.yaml").read_bytes().decode())
        return outcome()

    monkeypatch.setattr(flows.pipeline, "run_pipeline", run_pipeline)
    monkeypatch.chdir(workspace)
    return CliRunner().invoke(app, ["run", *args]), seen


def _stage_failed():
    from flows.stages import StageFailed

    raise StageFailed("stage 'prepare' failed (exit 2): error: boom")


def _interrupted():
    raise KeyboardInterrupt


@pytest.mark.parametrize(("failure", "code"), [(_stage_failed, 1), (_interrupted, 130)], ids=["stage-failed", "ctrl-c"])
def test_failed_run_puts_params_back_byte_for_byte(workspace, monkeypatch, failure, code):
    params = workspace / "params.yaml"
    params.write_bytes(params.read_bytes().replace(b"\n", b"\r\n"))  # whatever the bytes, they come back
    before = params.read_bytes()
    result, seen = _invoke_run(workspace, monkeypatch, ["--set", "fr.epochs=3", "--stage", "prepare"], failure)
    assert result.exit_code == code
    assert "\n  epochs: 3\r" in seen[0]  # the delta was in place while the flow ran
    assert params.read_bytes() == before
    assert "params.yaml: put back as it was before this run" in result.output
    assert not [p for p in workspace.iterdir() if p.name.startswith(".params.yaml")]  # no temporary left
    if failure is _stage_failed:
        assert result.output.count("boom") == 1


def test_successful_run_keeps_the_delta(workspace, monkeypatch):
    result, _ = _invoke_run(workspace, monkeypatch, ["--set", "fr.epochs=3", "--stage", "prepare"], lambda: [])
    assert result.exit_code == 0, result.output
    assert load_yaml((workspace / "params.yaml").read_text())["fr"]["epochs"] == 3
    assert "put back" not in result.output


def test_undo_leaves_a_file_edited_since_alone(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_bytes(b"fr: {epochs: 12}  # x\n")
    undo = ParamsUndo(path)
    assert not undo.restore()  # nothing written yet
    path.write_bytes(b"fr: {epochs: 3}  # x\n")
    undo.written()
    path.write_bytes(b"fr: {epochs: 4}  # edited by hand meanwhile\n")
    assert not undo.restore() and b"epochs: 4" in path.read_bytes()
    path.write_bytes(b"fr: {epochs: 3}  # x\n")
    assert undo.restore() and path.read_bytes() == b"fr: {epochs: 12}  # x\n"


def test_prefect_console_does_not_repeat_a_stage_failure():
    from faceops.cli import _StageFailureEcho
    from flows.stages import StageFailed

    echo = _StageFailureEcho()

    def record(message, exc=None):
        exc_info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, (), exc_info)

    failed = StageFailed("stage 'prepare' failed (exit 2): error: boom")
    assert not echo.filter(record("Task run failed with exception: %r", failed))
    assert not echo.filter(record('Finished in state Failed("Task run encountered an exception StageFailed: x")'))
    assert echo.filter(record("error: boom"))  # the stage's own output line stays
    assert echo.filter(record("Task run failed with exception", ValueError("a bug: keep its traceback")))
