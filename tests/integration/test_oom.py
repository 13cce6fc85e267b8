"""Out of device memory (issue 13's ``--explain-oom``, as the loop's fault policy): when XLA reports
memory exhausted, at compile time or in a step, the run logs the predicted breakdown of its layout
next to what XLA reported, and the cheapest single changes with their predicted need."""

import os

import pytest
from tiny import tiny_config

import jaxcolossal.train.loop as loop
import jaxcolossal.train.start as start
from jaxcolossal.config import load_config
from jaxcolossal.memory.budget import need
from jaxcolossal.memory.oom import explain_oom, is_oom, oom_changes
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.state import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OOM = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123,456,789 bytes.")


def test_the_explanation_ranks_the_changes_that_lower_the_need():
    cfg = tiny_config({"data_parallel_size": 8, "zero_stage": 0}, "bf16", training={"gradient_accumulation_steps": 1})
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    assert is_oom(OOM) and not is_oom(ValueError("shapes do not match"))
    now = need(cfg, 8, "cpu")["total"]
    changes = oom_changes(cfg, plan.mesh_shape)
    names = [n for n, _ in changes]
    assert {"parallel.zero_stage=1", "model.remat=full", "training.gradient_accumulation_steps=2",
            "offload.offload_optim_frac=1"} <= set(names)
    needs = [n["total"] for _, n in changes]
    assert needs == sorted(needs) and all(x < now for x in needs)  # each lowers the need; cheapest first
    capacity = (needs[0] + now) // 2  # between the best change and the current layout
    text = explain_oom(plan, OOM, None, capacity)
    assert "out of device memory: RESOURCE_EXHAUSTED" in text
    assert "XLA reported:  123,456,789 bytes" in text
    assert f"predicted per device for this layout (mesh {plan.mesh_shape}" in text
    first = text.splitlines()[text.splitlines().index("cheapest changes (one key each; predicted per-device need):") + 1]
    assert first.split()[0] == names[0] and first.endswith("fits")


def test_the_main_job_explains_an_out_of_memory_compile(tmp_path, monkeypatch, capfd):
    class Lowered:
        def compile(self, **options):
            raise OOM

    class Step:
        def lower(self, *a):
            return Lowered()

    monkeypatch.setattr(start, "make_train_step", lambda *a, **k: Step())
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"),
                      ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
                       "training.seq_len=32", "training.batch_size=16", "data.max_corpus_bytes=100000",
                       "logging.progress_bar=false", f"logging.run_dir={tmp_path}/run"])
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        loop.train(cfg)
    logged = capfd.readouterr().err
    assert "cheapest changes" in logged and "XLA reported:  123,456,789 bytes" in logged, logged[-2000:]
