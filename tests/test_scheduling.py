"""Scheduling inside the pipeline flow: which ready stage gets a free slot, and how the cores are shared between
stages running side by side, including a training that takes the cores a finished stage leaves."""

from __future__ import annotations

import threading
import time

import torch

from flows.pipeline import _chain_lengths, _CoreShare, _Slots
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


def test_a_freed_slot_goes_to_the_waiting_stage_with_the_highest_priority():
    slots, order, started = _Slots(1), [], threading.Event()
    release = threading.Event()

    def first():
        with slots.hold(0):
            started.set()
            release.wait(5)

    def waiter(name, priority):
        with slots.hold(priority):
            order.append(name)

    holder = threading.Thread(target=first)
    holder.start()
    started.wait(5)
    threads = [threading.Thread(target=waiter, args=(n, p)) for n, p in (("low", 1), ("high", 3), ("mid", 2))]
    for t in threads:
        t.start()
        time.sleep(0.05)  # all three wait before the slot frees
    release.set()
    for t in [holder, *threads]:
        t.join(5)
    assert order == ["high", "mid", "low"]


def test_slots_let_at_most_n_stages_in_at_once():
    slots, lock = _Slots(2), threading.Lock()
    inside = {"now": 0, "max": 0}

    def work():
        with slots.hold():
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
