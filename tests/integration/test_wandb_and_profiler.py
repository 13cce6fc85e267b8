"""Issue 45's W&B and profiler acceptance on the main job (configs/llama_tiny.yaml at a small size,
as tests/integration/test_main_job.py runs it), one training run shared by the assertions:

* an offline W&B run holds the same metrics as TensorBoard: the same names, the same values at the
  same steps (read back with W&B's own record schema and TensorBoard's own reader);
* ``logging.profile_steps=3-5`` writes a trace that xprof (TensorBoard's profile plugin's converter)
  opens, holding steps 3, 4 and 5 and no other;
* ``logging.wandb=true`` without the wandb package is refused in one line, exit 2, before compiling.
"""

import glob
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from jaxcolossal import metrics as mx
from jaxcolossal.config import load_config
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0",
         "data.max_corpus_bytes=400000", "logging.progress_bar=false", "logging.log_every=1",
         "training.eval_every=3", "training.max_steps=6"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One run of the main job with TensorBoard, an offline W&B run and a trace of steps 3-5."""
    pytest.importorskip("wandb")  # the test extra installs it
    out = tmp_path_factory.mktemp("obs") / "run"
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"),
                      SMALL + [f"logging.run_dir={out}", "logging.tensorboard=true", "logging.wandb=true",
                               "logging.wandb_mode=offline", "logging.wandb_project=obs-test",
                               "logging.profile_steps=3-5"])
    train(cfg)
    return out


def _run_id(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        (start,) = [r for r in map(json.loads, f) if r.get("event") == "run_start"]
    return start["run"]


def read_wandb_records(path):
    """The records of a ``.wandb`` file, as ``wandb.proto.wandb_internal_pb2.Record`` messages.

    The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
    LevelDB's log format: 32 KiB blocks of chunks, each with a header (CRC-32 of its type byte and
    data, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of one serialized record.
    wandb 0.31 reads it in Go (wandb-core) and has no Python reader, so it is read here, each chunk's
    checksum checked, and each record parsed with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2  # optional: the wandb package
    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and n == 0):  # the rest of a block is padding
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad checksum at byte {pos} of {path}"
        pending, pos = pending + chunk, pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_history(records):
    """``{name: {step: value}}`` of the logged scalars (W&B's own ``_step``, ``_runtime`` ... left out)."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):
                    out.setdefault(name, {})[r.history.step.num] = json.loads(item.value_json)
    return out


def test_offline_wandb_run_holds_the_same_metrics_as_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional: tensorboard
    run_id = _run_id(run_dir)
    (wandb_file,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    records = read_wandb_records(wandb_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.display_name, run.project) == (run_id, run_id, "obs-test")
    history = wandb_history(records)

    acc = EventAccumulator(str(run_dir / "tensorboard" / run_id))
    acc.Reload()
    board = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert set(history) == set(board), set(history) ^ set(board)
    assert {"train/loss", "train/lr", "train/tflops_6n", "eval/val_loss"} <= set(history)
    for name, by_step in board.items():
        assert sorted(history[name]) == sorted(by_step), name  # the same steps
        steps = sorted(by_step)
        np.testing.assert_allclose([history[name][s] for s in steps], [by_step[s] for s in steps],
                                   rtol=1e-6, err_msg=name)  # TensorBoard keeps float32
    assert sorted(history["train/loss"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(history["eval/val_loss"]) == [0, 3, 6]
    with open(run_dir / "metrics.jsonl") as f:  # W&B keeps the values metrics.jsonl has, to the last digit
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert history["train/loss"] == losses


def test_profile_trace_of_steps_3_to_5_opens_in_xprof(run_dir):
    from xprof.convert import raw_to_tool_data  # optional: xprof, TensorBoard's profile plugin's converter
    run_id = _run_id(run_dir)
    (xplane,) = glob.glob(str(run_dir / "profile" / run_id / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert glob.glob(os.path.join(os.path.dirname(xplane), "*.trace.json.gz"))  # for Perfetto
    data, content_type = raw_to_tool_data.xspace_to_tool_data([xplane], "trace_viewer@", {})
    assert content_type == "application/json"
    events = json.loads(data)["traceEvents"]
    steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("train "))
    assert steps == ["train 3", "train 4", "train 5"]  # the chosen steps and no other
    assert any("Execute" in str(e.get("name", "")) for e in events)  # the steps' XLA executions are in it
    names = {str(e.get("name", "")) for e in events}
    assert any("train_step" in n for n in names) and not any("unnamed" in n for n in names), \
        sorted(n for n in names if "jit" in n)  # issue 54 item 18: the step is named in the trace
    overview, _ = raw_to_tool_data.xspace_to_tool_data([xplane], "overview_page", {})
    assert overview


def test_wandb_without_the_package_is_refused_before_compiling(tmp_path):
    blocker = tmp_path / "no_wandb"
    blocker.mkdir()
    (blocker / "wandb.py").write_text("raise ImportError('No module named wandb')\n")  # as if not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), *SMALL,
                          f"logging.run_dir={tmp_path}/run", "logging.wandb=true"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: logging.wandb=true needs the wandb package: pip install wandb"), last
    assert "Traceback" not in out.stderr and "compiled" not in out.stderr + out.stdout


def test_log_completions_goes_to_wandb_as_a_table(tmp_path, monkeypatch):
    """Issue 54 item 11: posttrain.log_completions' rows become the offline W&B run's ``completions`` table."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [{"step": 1, "prompt": "1+2=", "completion": "3", "exact_match": 1.0, "reward": 1.0, "advantage": 0.5}]
    w = mx.MetricsWriter(str(tmp_path), sinks=[mx.WandbSink(str(tmp_path), "completions-table", mode="offline")])
    w.table(1, "completions", rows)
    w.close()
    (table,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "completions_*.json"))
    got = json.load(open(table))
    assert got["columns"] == list(rows[0]) and got["data"] == [list(rows[0].values())], got
