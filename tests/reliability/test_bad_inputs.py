"""Every malformed input of the corpus (``tests/reliability/corpus.py``) is refused with a non-zero exit and one
clear line naming the input and the problem, without a traceback, and leaves prior outputs and the input intact
with nothing left behind."""

from __future__ import annotations

import pickle

import pytest

from tests.reliability import corpus


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return corpus.Context(tmp_path_factory.mktemp("bad-inputs-cache"))


def test_corpus_covers_every_entry_point():
    ids = [c.id for c in corpus.CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)
    entries = corpus.entry_points()
    for needed in ("faceops stage prepare", "faceops stage validate", "faceops stage evaluate", "faceops run",
                   "faceops export", "faceops sweep train_fr", "faceops data ls", "faceops ls",
                   "python -m tasks.validate", "python -m tasks.train_fr"):
        assert needed in entries, needed
    processes = [c for c in corpus.CASES if c.entry.startswith(corpus.SUBPROCESS)]
    assert 3 <= len(processes) <= 5


def _param(case: corpus.Case):
    # real processes and the Great Expectations gate take seconds each; the rest run in-process in about one
    slow = case.entry.startswith(corpus.SUBPROCESS) or case.id.startswith("gate-")
    return pytest.param(case, id=case.id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("case", [_param(c) for c in corpus.CASES])
def test_bad_input_is_refused_cleanly(case, ctx, tmp_path):
    outcome = corpus.run_case(case, ctx, tmp_path)
    assert outcome.handled_well, outcome.explain()


def test_control_the_validate_cases_start_from_a_passing_dataset(ctx, tmp_path):
    """The unmodified prepared set passes the gate, so each validate case fails because of its one defect."""
    ws = corpus.Workspace(tmp_path, ctx)
    ws.project()
    ws.prepared()
    code, _, stderr = corpus._in_process(corpus.Invocation(("stage", "validate"), ws.root), corpus.QUIET_ENV)
    assert code == 0, stderr


def test_control_the_malicious_pickle_does_run_code_when_unpickled_plainly(tmp_path):
    """The refused ``.bin`` is a real attack: plain ``pickle.loads`` executes its command."""
    marker = tmp_path / "ran"
    pickle.loads(corpus.malicious_bin(marker))  # noqa: S301 - the point of the test
    assert marker.exists()
