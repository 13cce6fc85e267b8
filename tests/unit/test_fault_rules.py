"""Issue 44's rules without processes: the hang watchdog's limit on a fake clock, the goodput
summary of a job with a failed attempt, the straggler rule, the restart count."""
import json

import pytest

from jaxcolossal.runtime.faults import HANG_EXIT_CODE, restart_count
from jaxcolossal.runtime.goodput import (
    CATEGORIES,
    GoodputRecorder,
    StragglerTracker,
    read_records,
    stragglers,
    summarize,
    summary_lines,
)
from jaxcolossal.runtime.watchdog import HangWatchdog, hang_limit


class FakeClock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_hang_limit_is_the_larger_of_the_timeout_and_factor_times_the_median():
    assert hang_limit(5, 10, []) == 5
    assert hang_limit(5, 10, [0.1, 0.2, 100.0]) == 5      # median 0.2: 2 s < 5 s
    assert hang_limit(5, 10, [1.0, 2.0, 3.0]) == 20       # median 2 s x 10
    assert HANG_EXIT_CODE == 75


def test_watchdog_fires_only_after_the_limit_and_not_before_the_first_step():
    clock, fired = FakeClock(), []
    w = HangWatchdog(5, 10, clock=clock, on_fire=fired.append, process_index=1)
    clock.t = 1000.0                       # start-up and compile: unarmed, never fires
    assert not w.check()
    w.step_done(1)
    for step in range(2, 12):              # steps of 1 s: limit max(5, 10 x 1) = 10 s
        clock.t += 1.0
        w.step_done(step)
    assert w.limit() == 10
    w.phase("in step 12's train_step dispatch")
    clock.t += 9.9
    assert not w.check()
    w.progress("in checkpoint save at step 11")  # a phase boundary restarts the count
    clock.t += 9.9
    assert not w.check() and not fired
    w.phase("in step 12's train_step dispatch")
    clock.t += 0.2
    assert w.check()
    assert len(fired) == 1 and "process 1" in fired[0] and "in step 12's train_step dispatch" in fired[0]
    assert "last step finished: 11" in fired[0] and "limit 10.0 s" in fired[0]
    assert not w.check()                   # once


def test_disabled_watchdog_never_fires():
    w = HangWatchdog(0, 10, clock=FakeClock(), on_fire=pytest.fail)
    w.step_done(1)
    assert not w.enabled and not w.check()


def _attempt(path, attempt, start, clock, steps, resumed_from, step_s=1.0, fail=False):
    rec = GoodputRecorder(str(path), attempt, start=start, clock=clock)
    clock.t = start + 3.0                       # imports, mesh, data
    with rec.phase("checkpoint_load"):
        clock.t += 0.5
    rec.resumed(resumed_from, "local" if resumed_from else "none")
    with rec.phase("compilation"):
        clock.t += 2.0
    rec.enter("productive")
    for s in range(resumed_from + 1, steps + 1):
        with rec.phase("data_waiting"):
            clock.t += 0.1
        clock.t += step_s
        rec.step_done(s)
        if s % 4 == 0:
            with rec.phase("checkpoint_save"):
                clock.t += 0.2
    if fail:
        clock.t += 0.7                          # the failed attempt runs on a little after its last record
        return None
    rec.enter("other")
    clock.t += 0.3
    return rec.finish()


def test_goodput_of_a_job_with_one_failure_adds_up_and_counts_the_lost_steps(tmp_path):
    path, clock = tmp_path / "goodput.jsonl", FakeClock()
    _attempt(path, 0, 100.0, clock, steps=10, resumed_from=0, fail=True)   # dies after step 10
    restart_at = clock.t + 5.0                                             # 5 s to detect and relaunch
    _attempt(path, 1, restart_at, clock, steps=12, resumed_from=8)         # resumes from step 8
    s = summarize(read_records(str(path)))
    assert s["attempts"] == 2 and s["steps_lost"] == 2
    assert s["restarts"][0]["resumed_from"] == 8 and s["restarts"][0]["source"] == "local"
    assert s["wall_s"] == pytest.approx(clock.t - 100.0)
    assert abs(sum(s["seconds"].values()) - s["wall_s"]) <= 0.02 * s["wall_s"]
    assert s["seconds"]["restart"] == pytest.approx(5.7)                    # 0.7 s unrecorded + the gap
    assert s["seconds"]["wasted"] == pytest.approx(2.0)                     # 2 steps of 1 s
    assert s["seconds"]["productive"] == pytest.approx(10 + 4 - 2)
    assert s["goodput"] == pytest.approx(12 / s["wall_s"])
    lines = summary_lines(s)
    assert "restart 1: resumed from step 8 (local), 2 steps lost (2.0 s)" in lines[1]
    # a new job (attempt 0 again) in the same file starts a new summary
    _attempt(path, 0, clock.t + 50, clock, steps=4, resumed_from=0)
    assert summarize(read_records(str(path)))["attempts"] == 1


def test_a_line_cut_by_a_killed_process_is_ignored(tmp_path):
    path, clock = tmp_path / "goodput.jsonl", FakeClock()
    _attempt(path, 0, 0.0, clock, steps=3, resumed_from=0)
    with open(path, "a") as f:
        f.write(json.dumps({"event": "progress"})[:9])
    assert set(summarize(read_records(str(path)))["seconds"]) >= set(CATEGORIES)


def test_straggler_rule_names_the_rank_above_factor_times_the_others_median():
    assert stragglers([1.0, 1.0, 1.6, 1.0], 1.5) == [2]
    assert stragglers([1.0, 1.4, 1.0], 1.5) == []
    assert stragglers([0.5, 1.0], 1.5) == [1]
    assert stragglers([1.0], 1.5) == []
    assert stragglers([0.002, 0.0035], 1.5, floor_s=0.03) == []   # 1.5 ms above: under a 30 ms floor


def test_no_straggler_warning_for_1_ms_of_data_loading_on_a_600_ms_step():
    # issue 54 item 16: 2 processes, data loading 2-3.5 ms alternating between them on a 600 ms step:
    # the old rule (factor x the other's time, at every check) named one of them at most checks
    t = StragglerTracker(factor=1.5, min_share=0.05, min_s=0.01, checks=3)
    warned = []
    for check in range(40):
        data = [0.002, 0.0035] if check % 2 else [0.0035, 0.002]
        steps = [0.600, 0.601] if check % 3 else [0.601, 0.600]
        warned += t.update("data-loading time", data, 0.6) + t.update("step time", steps, 0.6)
    assert warned == []
    old = sum(bool(stragglers([0.002, 0.0035] if c % 2 else [0.0035, 0.002], 1.5)) for c in range(40))
    assert old == 40  # what the issue saw: a warning at every logged step


def test_a_persistent_straggler_is_named_once_after_straggler_checks_in_a_row():
    t = StragglerTracker(factor=1.5, min_share=0.05, min_s=0.01, checks=3)
    slow = [0.01, 0.01, 0.20, 0.01]          # rank 2 waits 200 ms for data on a 600 ms step (floor 30 ms)
    assert t.floor(0.6) == pytest.approx(0.03) and t.floor(0.05) == 0.01
    assert [t.update("data-loading time", slow, 0.6) for _ in range(6)] == [[], [], [2], [], [], []]
    assert t.update("data-loading time", [0.01] * 4, 0.6) == []           # recovered: the run of checks ends
    assert [t.update("data-loading time", slow, 0.6) for _ in range(3)] == [[], [], [2]]
    # the step-time and data-loading rules count apart; 1 check in a row is the old behaviour, with a floor
    assert StragglerTracker(1.5, 0.05, 0.01, checks=1).update("step time", [1.0, 1.0, 1.6, 1.0], 1.0) == [2]
    assert StragglerTracker(1.5, 0.05, 0.7, checks=1).update("step time", [1.0, 1.0, 1.6, 1.0], 1.0) == []


def test_restart_count_reads_the_first_variable_set():
    assert restart_count({}) == 0
    assert restart_count({"SLURM_RESTART_COUNT": "3"}) == 3
    assert restart_count({"JAXCOLOSSAL_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) == 1
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2", "SLURM_RESTART_COUNT": "5"}) == 2
