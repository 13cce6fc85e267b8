"""The loop's fault policies (jaxcolossal.train.guard) and the small pieces around them: strict
JSON metrics, printable samples, the warmup's first step, throughput that leaves out pauses."""

import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging
from tiny import random_batches, setup, tiny_config

from jaxcolossal.config import PrecisionConfig, TrainingConfig
from jaxcolossal.generate import printable
from jaxcolossal.metrics import json_line
from jaxcolossal.train.guard import NonFiniteError, NonFiniteGuard, StoppedBeforeTraining, StopSignals
from jaxcolossal.train.report import StepClock, quiet_console
from jaxcolossal.train.optimizer import lr_schedule


def _m(nonfinite, loss=1.0, norm=1.0, **extra):
    return {"nonfinite": nonfinite, "loss": loss, "grad_norm": norm, **extra}


def test_stop_policy_stops_at_the_first_nonfinite_step():
    g = NonFiniteGuard("stop", PrecisionConfig(bf16=True))
    g.check(1, _m(0))
    with pytest.raises(NonFiniteError, match=r"step 2: loss nan, grad_norm nan is not finite") as e:
        g.check(2, _m(1, float("nan"), float("nan")))
    assert e.value.step == 2


def test_skip_policy_stops_after_k_in_a_row():
    g = NonFiniteGuard("skip", PrecisionConfig(max_consecutive_skips=3))
    for step, flag in enumerate([1, 1, 0, 1, 1], 1):  # the streak resets on a finite step
        g.check(step, _m(flag, float("inf")))
    with pytest.raises(NonFiniteError, match="3 consecutive non-finite steps"):
        g.check(6, _m(1, float("inf")))


def test_fp16_overflow_is_the_scalers_business_until_min_scale():
    pc = PrecisionConfig(fp16=True, max_consecutive_skips=2, min_scale=1.0)
    g = NonFiniteGuard("stop", pc)  # "stop" does not apply to fp16 overflow: skipping is loss scaling
    for step in range(1, 6):
        g.check(step, _m(1, loss_scale=1024.0))
    with pytest.raises(NonFiniteError, match="consecutive steps overflowed with the loss scale at its minimum"):
        g.check(6, _m(1, loss_scale=1.0))


def test_second_ctrl_c_aborts_at_once():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.received == "SIGINT" and stop.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_during_start_up_stops_at_the_next_boundary_one_after_it_does_not():
    """Issue 45 item 5: before start_training a signal raises at the next check, naming the phase
    just finished; after it, the flag is the step loop's (save and stop)."""
    with StopSignals() as stop:
        stop.check("loading the data")  # no signal: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        with pytest.raises(StoppedBeforeTraining, match=r"^SIGTERM received: stopped before training started "
                                                        r"\(after compiling the train step\); no step ran and "
                                                        r"nothing was saved$") as e:
            stop.check("compiling the train step")
        assert e.value.exit_code == 143 and e.value.after == "compiling the train step"
        with pytest.raises(StoppedBeforeTraining):  # the last boundary too
            stop.start_training(after="the evaluation at step 0")
    with StopSignals() as stop:
        stop.start_training(after="the evaluation at step 0")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        stop.check("anything")  # a signal during training is the step loop's: save and stop
        assert stop and stop.exit_code == 143


def test_sigterm_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop and stop.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_metrics_lines_are_strict_json():
    line = json_line({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    rec = json.loads(line, parse_constant=lambda c: pytest.fail(c))
    assert rec == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3,
                   "nonfinite_values": {"loss": "nan", "grad_norm": "inf"}}
    assert json.loads(json_line({"step": 1, "loss": 2.5})) == {"step": 1, "loss": 2.5}


def test_sample_text_escapes_control_bytes():
    assert printable("def f():\n\tx\x07\x1b[2J\x00") == "def f():\n\tx\\x07\\x1b[2J\\x00"


def test_warmup_first_step_moves():
    t = TrainingConfig(learning_rate=1.0, warmup_steps=4, max_steps=10, min_learning_rate_ratio=0.1)
    lr = [float(lr_schedule(t)(jnp.int32(s))) for s in range(10)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and lr[9] == pytest.approx(0.1)
    assert float(lr_schedule(TrainingConfig(learning_rate=1.0, warmup_steps=0))(jnp.int32(0))) == 1.0


def test_step_clock_leaves_out_pauses():
    clock = StepClock(0)
    time.sleep(0.05)
    with clock.paused(None):
        time.sleep(0.5)
    assert clock.lap(5) < 0.05  # 5 steps in ~0.05 s; the 0.5 s pause is not theirs


def test_orbax_metric_warning_stays_off_the_console(capsys):
    with quiet_console():
        absl_logging.warning("Requested `tracked_metric`; did not provide metrics.")
    assert "tracked_metric" not in capsys.readouterr().err
    assert not logging.getLogger("absl").filters


def test_nonfinite_step_is_not_applied_in_bf16():
    """The same select runs in every precision (train/step.py); fp32 is exercised end to end by
    tests/integration/test_nothing_lost.py, fp16 by tests/integration/test_fused_adamw_zero.py."""
    cfg = tiny_config({"data_parallel_size": 1}, precision="bf16", training={"learning_rate": 1e30})
    plan, _, state, step = setup(cfg, jax.devices()[:1])
    for i, x in enumerate(random_batches(cfg, 6)):
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        before = jax.device_get(state)
        state, m = step(state, batch)
        if int(m["nonfinite"]):
            after = jax.device_get(state)
            jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
            jax.tree.map(np.testing.assert_array_equal, after.master, before.master)
            jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
            assert int(after.step) == int(before.step) + 1
            return
    pytest.fail("a learning rate of 1e30 should produce a non-finite step within 6 steps")



def test_watch_checks_one_step_late_and_flush_at_once():
    g = NonFiniteGuard("stop", PrecisionConfig())
    g.watch(1, _m(0))
    g.watch(2, _m(1, float("nan")))  # held: step 3 may be dispatched before step 2's flag is read
    with pytest.raises(NonFiniteError, match="step 2: loss nan"):
        g.watch(3, _m(0))
    g = NonFiniteGuard("stop", PrecisionConfig())
    g.watch(5, _m(1, float("inf")))
    with pytest.raises(NonFiniteError, match="step 5"):
        g.flush()
    g.flush()  # nothing held any more
