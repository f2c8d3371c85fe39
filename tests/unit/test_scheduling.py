"""Scheduling inside the pipeline flow: which ready stage gets a free slot, exclusive stages running alone, and each
stage's thread count fixed from params whatever runs beside it."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import yaml

from flows.stages import _chain_lengths, _Slots
from ml.errors import ConfigError
from tasks.common import fix_stage_threads, single_threaded_children, stage_cores
from tasks.pipeline import PipelineConfig, stage_threads


def test_chain_lengths_put_the_critical_path_first():
    graph = {  # stage: the stages it depends on, in dependency order (as stage_graph returns it)
        "prepare": [], "train_fr": ["prepare"], "train_aligner": ["prepare"], "align": ["train_aligner"],
        "fusion": ["train_fr"], "generator": ["train_fr"], "synthesize": ["generator"],
        "train_fr_syn": ["synthesize"], "evaluate": ["align", "fusion", "train_fr_syn"],
    }
    lengths = _chain_lengths(graph)
    assert lengths["evaluate"] == 0 and lengths["fusion"] == 1 and lengths["align"] == 1
    assert lengths["generator"] == 3 and lengths["train_fr"] == 4 and lengths["train_aligner"] == 2
    assert lengths["prepare"] == 5


def _hold_then_record(slots, stage, order, hold_seconds=0.0):
    with slots.hold(stage):
        order.append(stage)
        time.sleep(hold_seconds)


def _start(target, *args):
    thread = threading.Thread(target=target, args=args)
    thread.start()
    return thread


# a: three stages after it (a → x → y → z); b: one (b → z); c: none
CHAINS = {"first": [], "a": [], "x": ["a"], "y": ["x"], "b": [], "z": ["y", "b"], "c": []}


def test_a_freed_slot_goes_to_the_waiting_stage_on_the_longest_chain():
    slots, order, release = _Slots(1, CHAINS, grace=0.0), [], threading.Event()  # no stage expected after one ends
    started = threading.Event()

    def first():
        with slots.hold("first"):
            started.set()
            release.wait(5)

    threads = [_start(first)]
    started.wait(5)
    for stage in ("c", "a", "b"):
        threads.append(_start(_hold_then_record, slots, stage, order))
        time.sleep(0.05)  # all three wait before the slot frees
    release.set()
    for t in threads:
        t.join(5)
    assert order == ["a", "b", "c"]


def test_a_stage_whose_upstream_just_finished_is_not_overtaken_by_a_shorter_chain():
    """``x`` becomes ready when ``a`` finishes, but its task arrives a moment later than ``c``, which was already
    waiting: the slot must still go to ``x`` (two stages after it) rather than ``c`` (none)."""
    slots, order = _Slots(1, CHAINS, grace=1.0), []  # x arrives 0.3 s late; y (after x) never does
    a = _start(_hold_then_record, slots, "a", order, 0.2)
    time.sleep(0.05)
    c = _start(_hold_then_record, slots, "c", order)
    a.join(5)
    time.sleep(0.3)  # x's task is late
    x = _start(_hold_then_record, slots, "x", order)
    for t in (c, x):
        t.join(5)
    assert order == ["a", "x", "c"]


def test_an_expected_stage_that_never_comes_holds_nothing_up_for_long():
    slots, order = _Slots(1, CHAINS, grace=0.3), []
    a = _start(_hold_then_record, slots, "a", order, 0.1)
    time.sleep(0.02)
    c = _start(_hold_then_record, slots, "c", order)
    for t in (a, c):
        t.join(5)
    assert order == ["a", "c"]  # x never arrived: c went once the expectation lapsed


def test_a_failed_stage_makes_nothing_after_it_expected():
    slots, order = _Slots(1, CHAINS, grace=30.0), []

    def fail():
        with contextlib.suppress(RuntimeError), slots.hold("a"):
            raise RuntimeError("stage failed")

    _start(fail).join(5)
    c = _start(_hold_then_record, slots, "c", order)
    c.join(5)
    assert order == ["c"]


def test_slots_let_at_most_n_stages_in_at_once():
    slots, lock = _Slots(2), threading.Lock()
    inside = {"now": 0, "max": 0}

    def work():
        with slots.hold("c"):
            with lock:
                inside["now"] += 1
                inside["max"] = max(inside["max"], inside["now"])
            time.sleep(0.02)
            with lock:
                inside["now"] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert inside["max"] == 2


def test_an_exclusive_stage_waits_to_run_alone_and_holds_back_the_rest():
    graph = {"a": [], "b": [], "solo": [], "c": []}
    slots = _Slots(2, graph, grace=0.0, exclusive=frozenset({"solo"}))
    inside: list[set[str]] = []
    now: set[str] = set()
    lock = threading.Lock()

    def work(stage: str, seconds: float) -> None:
        with slots.hold(stage):
            with lock:
                now.add(stage)
                inside.append(set(now))
            time.sleep(seconds)
            with lock:
                now.discard(stage)

    threads = [_start(work, "a", 0.3), _start(work, "b", 0.3)]
    time.sleep(0.05)
    threads += [_start(work, "solo", 0.2)]
    time.sleep(0.05)
    threads += [_start(work, "c", 0.05)]  # arrives after solo: waits behind it, though a slot frees first
    for t in threads:
        t.join(5)
    assert {"solo"} in inside and all(s == {"solo"} or "solo" not in s for s in inside)
    solo_at = inside.index({"solo"})
    assert all("c" not in s for s in inside[:solo_at])


def test_thread_counts_follow_params_and_cores_only():
    cfg = PipelineConfig(jobs=2, exclusive=("prepare", "train_fr@synthetic"))
    assert stage_threads("train_fr@real", cfg, 8) == 4 and stage_threads("train_fr@synthetic", cfg, 8) == 8
    assert stage_threads("prepare", cfg, 2) == 2 and stage_threads("train_fusion", cfg, 2) == 1
    assert stage_threads("train_fusion", cfg, 1) == 1  # never 0
    assert stage_threads("train_fusion", PipelineConfig(jobs=1), 8) == 8  # one at a time: every stage alone
    assert stage_threads("train_fusion", PipelineConfig(jobs=3), 8) == 2
    with pytest.raises(ConfigError, match="pipeline.exclusive: 'train_frr@real' is not a stage"):
        PipelineConfig(exclusive=("train_frr@real",))
    with pytest.raises(ConfigError, match="pipeline.jobs = 0"):
        PipelineConfig(jobs=0)


def test_a_stage_fixes_its_threads_at_start_from_params(tmp_path, monkeypatch):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"pipeline": {"jobs": 2, "exclusive": ["evaluate"]}}))
    monkeypatch.setattr("ml.train.device.available_cores", lambda: 4)
    before = torch.get_num_threads()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "7")  # what a caller left in the environment does not count
    try:
        assert fix_stage_threads("train_fusion", params) == 2 and torch.get_num_threads() == 2
        assert stage_cores() == 2  # what the stage fans out to (prepare's processes) follows it
        assert fix_stage_threads("evaluate", params) == 4 and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_children_started_in_the_block_get_one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    with single_threaded_children():
        import os

        assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "2" and "OPENBLAS_NUM_THREADS" not in os.environ
