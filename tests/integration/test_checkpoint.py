"""Checkpoints users can trust: retention, corrupt-step recovery, resharding restore, refusals.

Signals and loop-level recovery: tests/integration/test_nothing_lost.py."""

import logging
import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tiny import run_steps, tiny_config

from jaxcolossal.checkpoint import CheckpointError, CheckpointManager, NonFiniteStateError
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_keeps_last_n_and_the_best(tmp_path):
    _, _, plan = run_steps(tiny_config(), jax.devices()[:1], steps=0)
    state = init_state(plan, build_optimizer(plan.cfg.training, plan), key=jax.random.key(0))
    cm = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step, val in [(1, 3.0), (2, None), (3, 1.0), (4, 2.0), (5, None), (6, 4.0), (7, None)]:
        cm.save(step, state, val_loss=val)
    cm.wait()
    assert cm.all_steps() == [3, 6, 7]  # the two newest, plus the best val_loss (step 3)
    assert cm.best_step() == 3 and cm.latest_step() == 7
    cm.close()


def test_corrupt_latest_step_is_skipped_with_a_warning(tmp_path, caplog):
    state, _, plan = run_steps(tiny_config(), jax.devices()[:1], steps=1)
    cm = CheckpointManager(str(tmp_path), max_to_keep=5)
    cm.save(1, state)
    cm.wait()
    state2 = state.replace(step=state.step + 1)
    cm.save(2, state2)
    cm.wait()
    # truncate every data file of step 2, as a crash mid-copy or a bad disk would
    for dirpath, _, files in os.walk(tmp_path / "2"):
        for f in files:
            if not f.startswith("_"):
                with open(os.path.join(dirpath, f), "r+b") as fh:
                    fh.truncate(3)
    log = logging.getLogger("jaxcolossal")  # it does not propagate once the run's logger is set up
    log.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = cm.restore(state)
    finally:
        log.removeHandler(caplog.handler)
    assert int(restored.step) == 1
    assert [str(w.message) for w in caught if "checkpoint" in str(w.message)] == []  # no Python warning
    lines = [r for r in caplog.records if "checkpoint step" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(lines) == 1
    msg = lines[0].getMessage()
    assert "\n" not in msg and len(msg) < 300, msg  # one short line, no TensorStore repr
    assert msg.endswith(f"checkpoint step 2 is skipped: its data files are truncated or corrupt; it was moved to "
                        f"{tmp_path}/damaged/{os.listdir(tmp_path / 'damaged')[0]} and an older step is tried"), msg
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
    cm.save(3, state2.replace(step=state.step + 2))  # later saves still happen
    cm.wait()
    assert 3 in cm.all_steps()
    cm.close()


@pytest.mark.parametrize("target", ["tp2_zero1_on_4", "one_device"])
def test_restore_onto_another_layout(tmp_path, target):
    src_cfg = tiny_config({"data_parallel_size": 8, "zero_stage": 3})
    state, _, _ = run_steps(src_cfg, jax.devices(), steps=2)
    cm = CheckpointManager(str(tmp_path))
    cm.save(2, state)
    cm.wait()
    if target == "tp2_zero1_on_4":
        cfg, devices = tiny_config({"tensor_parallel_size": 2, "zero_stage": 1}), jax.devices()[:4]
    else:
        cfg, devices = tiny_config({"data_parallel_size": 1}), jax.devices()[:1]
    plan = make_plan(cfg, make_mesh(cfg.parallel, devices))
    fresh = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(1))
    restored = cm.restore(fresh)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.opt_state), jax.device_get(state.opt_state))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):
        assert got.sharding == want.sharding  # every array carries the target sharding
    cm.close()


def test_nonfinite_val_loss_never_ranks_best(tmp_path):
    _, _, plan = run_steps(tiny_config(), jax.devices()[:1], steps=0)
    state = init_state(plan, build_optimizer(plan.cfg.training, plan), key=jax.random.key(0))
    cm = CheckpointManager(str(tmp_path), max_to_keep=1)
    cm.save(1, state, val_loss=2.0)
    with pytest.warns(RuntimeWarning, match="val_loss is nan; saved without it"):
        cm.save(2, state, val_loss=float("nan"))
    cm.save(3, state)
    cm.wait()
    assert cm.best_step() == 1 and cm.all_steps() == [1, 3]  # the NaN step is neither best nor kept
    cm.close()


def test_nonfinite_state_and_refused_saves_are_errors(tmp_path):
    _, _, plan = run_steps(tiny_config(), jax.devices()[:1], steps=0)
    state = init_state(plan, build_optimizer(plan.cfg.training, plan), key=jax.random.key(0))
    cm = CheckpointManager(str(tmp_path))
    cm.save(5, state)
    cm.wait()
    with pytest.raises(CheckpointError, match="step 3 was not saved: .* already holds step 5"):
        cm.save(3, state)  # orbax returns False for a step below the newest: never silently
    bad = state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.inf), state.params))
    with pytest.raises(NonFiniteStateError, match="step 6: the train state holds NaN or inf"):
        cm.save(6, bad)
    cm.wait()
    assert cm.all_steps() == [5]
    cm.close()


def test_restore_target_without_shardings_is_refused(tmp_path):
    state, _, _ = run_steps(tiny_config(), jax.devices()[:1], steps=1)
    cm = CheckpointManager(str(tmp_path))
    cm.save(1, state)
    cm.wait()
    host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(ValueError, match=r"restore target has \d+ leaves without a sharding \(e.g. step, params"):
        cm.restore(host)
    with pytest.raises(ValueError, match="without a sharding"):
        cm.restore(jax.device_get(state))  # numpy arrays
    cm.close()


def test_steps_written_before_the_config_item_still_restore(tmp_path):
    state, _, _ = run_steps(tiny_config(), jax.devices()[:1], steps=1)
    old = ocp.CheckpointManager(str(tmp_path), options=ocp.CheckpointManagerOptions(create=True))
    old.save(1, args=ocp.args.StandardSave(state))  # the format of the first release: one unnamed item
    old.wait_until_finished()
    old.close()
    cm = CheckpointManager(str(tmp_path))
    restored = cm.restore(state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
    params, step = cm.restore_params()
    assert step == 1 and cm.saved_config(1) == {}
    np.testing.assert_array_equal(params["layers"]["wq"], jax.device_get(state.params["layers"]["wq"]))
    cm.close()


def test_only_the_policy_is_read_from_a_checkpoint_holding_a_reference(tmp_path):
    """Issue 54 item 5: a DPO or GRPO step holds ``reference.*``; sampling and evaluation read the policy
    (``only=``) under any config, where a whole-state restore refuses the arrays the target lacks."""
    state = init_state(*_plan_and_tx(), key=jax.random.key(0))
    saved = state.replace(step=state.step + 3, reference=jax.tree.map(lambda x: x * 2, state.params),
                          params=jax.tree.map(lambda x: x + 1, state.params))
    cm = CheckpointManager(str(tmp_path), max_to_keep=2)
    cm.save(3, saved)
    cm.wait()
    with pytest.raises(CheckpointError, match="reference.embed_tokens: saved"):
        cm.restore(state)  # the whole state: the saved reference does not fit a target without one
    got = cm.restore(state, only=("step", "params", "frozen"))
    cm.close()
    assert int(got.step) == 3 and got.reference is None
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.params), jax.device_get(saved.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.opt_state), jax.device_get(state.opt_state))
    assert jax.tree.structure(got) == jax.tree.structure(state)


def _plan_and_tx():
    plan = make_plan(tiny_config(), make_mesh(tiny_config().parallel, jax.devices()[:1]))
    return plan, build_optimizer(plan.cfg.training, plan)
