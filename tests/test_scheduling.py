"""Scheduling inside the pipeline flow: which ready stage gets a free slot, and how the cores are shared between
stages running side by side, including a training that takes the cores a finished stage leaves."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from flows.stages import _chain_lengths, _CoreShare, _Slots
from ml.train.callbacks import FollowCoreShare
from tasks.common import core_share_callbacks, ENV_CORE_SHARE, stage_cores


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


def test_core_share_is_rewritten_as_stages_start_and_finish(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    share = _CoreShare()
    share.jobs = 2
    threads_a, file_a = share.enter("a")
    assert threads_a == 8 and file_a.read_text() == "8"  # alone: every core
    threads_b, file_b = share.enter("b")
    assert threads_b == 4 and file_a.read_text() == "4" and file_b.read_text() == "4"
    share.leave("a")
    assert not file_a.exists() and file_b.read_text() == "8"  # left alone: b takes a's cores
    share.leave("b")
    assert not file_b.parent.exists()  # the last one out removes the folder
    threads_c, file_c = share.enter("c")  # a later run gets a new one
    assert threads_c == 8 and file_c.read_text() == "8"
    share.leave("c")
    assert not file_c.parent.exists()


def test_follow_core_share_applies_the_file_and_ignores_garbage(tmp_path):
    before = torch.get_num_threads()
    path = tmp_path / "share"
    follow = FollowCoreShare(path, interval=0.0)
    try:
        assert follow.poll() == before  # no file yet: nothing changes
        path.write_text("1\n")
        assert follow.poll() == 1
        path.write_text("not a number")
        assert follow.poll() == 1
        path.write_text("2")
        assert follow.poll() == 2
    finally:
        torch.set_num_threads(before)


def test_stage_side_reads_the_share_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_CORE_SHARE, raising=False)
    assert core_share_callbacks() == []
    monkeypatch.setenv(ENV_CORE_SHARE, str(tmp_path / "share"))
    (callback,) = core_share_callbacks()
    assert isinstance(callback, FollowCoreShare) and callback.path == tmp_path / "share"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stage_cores() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert stage_cores() >= 1
