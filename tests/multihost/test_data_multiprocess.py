"""The data loader across 2 real processes (4 CPU devices each, gloo).

Each process must build only its own rows of the global batch, and the global ``jax.Array``
must equal the concatenation of the processes' rows in process order, i.e. the batch a single
process would build. A batch that does not split evenly must fail with a clear error.
"""

import pytest
from mh import clean_env, launcher, run, tagged_json

WORKER = r"""
import json
import numpy as np
from jaxcolossal.runtime.launch import launch_from_env
launch_from_env(verbose=False)
import jax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
from jaxcolossal.config import ParallelConfig
from jaxcolossal.data.loader import DataLoader, sample_windows
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import DATA_AXES

rank, nproc = jax.process_index(), jax.process_count()
tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
out = {"rank": rank, "nproc": nproc, "local_devices": jax.local_device_count()}
for name, par in {"zero3": ParallelConfig(zero_stage=3), "dp4_tp2": ParallelConfig(tensor_parallel_size=2),
                  "tp8": ParallelConfig(tensor_parallel_size=8)}.items():
    mesh = make_mesh(par)
    loader = DataLoader(tokens, 16, 12, seed=3, mesh=mesh, batch_spec=P(DATA_AXES))
    rows = loader.rows
    local = loader.local_batch(5)
    batch = loader.batch(5)
    full_in, full_tg = sample_windows(tokens, 5, 16, 12, 3)
    glob_in = np.asarray(multihost_utils.process_allgather(batch["inputs"], tiled=True))
    glob_tg = np.asarray(multihost_utils.process_allgather(batch["targets"], tiled=True))
    # what the other processes built, in process order
    all_local = np.asarray(multihost_utils.process_allgather(local["inputs"]))
    out[name] = {
        "rows": [rows.start, rows.stop] if isinstance(rows, slice) else np.asarray(rows).tolist(),
        "local_shape": list(local["inputs"].shape),
        "local_is_own_rows": bool(np.array_equal(local["inputs"], full_in[rows])
                                  and np.array_equal(local["targets"], full_tg[rows])),
        "global_equals_single_process": bool(np.array_equal(glob_in, full_in) and np.array_equal(glob_tg, full_tg)),
        "concat_in_process_order": bool(np.array_equal(np.concatenate(list(all_local)), full_in)),
        "addressable_rows": sorted({int(s.index[0].start or 0) for s in batch["inputs"].addressable_shards}),
    }
# chat rows (ExampleLoader) and packed windows: every key of the global batch equals one process's build
from jaxcolossal.data.loader import ExampleLoader
mesh = make_mesh(ParallelConfig(zero_stage=3))
ex = np.random.default_rng(1).integers(0, 256, (40, 13)).astype(np.int32)
mk = (np.random.default_rng(2).random((40, 12)) > 0.5).astype(np.float32)
docs = [0, 700, 2100, 4000]
checks = {}
for name, ld, ref in (
        ("chat", ExampleLoader(ex, mk, 16, 3, mesh=mesh, batch_spec=P(DATA_AXES)),
         ExampleLoader(ex, mk, 16, 3, process_index=0, process_count=1)),
        ("packed", DataLoader(tokens, 16, 12, 3, mesh=mesh, batch_spec=P(DATA_AXES), doc_starts=docs),
         DataLoader(tokens, 16, 12, 3, process_index=0, process_count=1, doc_starts=docs))):
    b, r = ld.batch(5), ref.local_batch(5)
    checks[name] = set(b) == set(r) and all(
        np.array_equal(np.asarray(multihost_utils.process_allgather(b[k], tiled=True)), r[k]) for k in r)
    checks[name + "_own_rows"] = list(ld.local_batch(5)["inputs"].shape)
out["other_loaders"] = checks
errors = {}
for name, kwargs in {"mesh_12": dict(batch_size=12, mesh=make_mesh(ParallelConfig(zero_stage=3))),
                     "no_mesh_15": dict(batch_size=15)}.items():
    try:
        DataLoader(tokens, seq_len=12, seed=3, batch_spec=P(DATA_AXES) if "mesh" in kwargs else None, **kwargs)
        errors[name] = None
    except ValueError as e:
        errors[name] = str(e)
out["errors"] = errors
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(120)
def test_each_process_builds_its_rows_and_the_global_batch_is_their_concatenation(tmp_path):
    prog = tmp_path / "data_worker.py"
    prog.write_text(WORKER)
    logs = tmp_path / "logs"
    res = run(launcher(2, str(prog), timeout_s=60, log_dir=logs, extra=("--platform", "cpu")),
              clean_env(), timeout=100)
    assert res.returncode == 0, res.describe()
    results = []
    for r in range(2):
        text = (logs / f"rank{r}.log").read_text()
        results.append(tagged_json(text)[0])

    for r, out in enumerate(results):
        assert (out["rank"], out["nproc"], out["local_devices"]) == (r, 2, 4)
        for name in ("zero3", "dp4_tp2"):
            # 8 batch shards (zero3: fsdp=8) or 4 (dp=4 × tp=2): process r owns rows 8r..8r+7 only
            got = out[name]
            assert got["rows"] == [8 * r, 8 * r + 8], (name, got)
            assert got["local_shape"] == [8, 12]
            assert got["local_is_own_rows"] and got["global_equals_single_process"]
            assert got["concat_in_process_order"]
            step = 2 if name == "zero3" else 4
            assert got["addressable_rows"] == list(range(8 * r, 8 * r + 8, step))
        # tp over all 8 devices: no batch sharding, every process holds the whole batch
        assert out["tp8"]["rows"] == [0, 16] and out["tp8"]["global_equals_single_process"]
        # chat rows with their loss mask, and packed windows with segment ids/positions/mask
        assert out["other_loaders"] == {"chat": True, "chat_own_rows": [8, 12],
                                        "packed": True, "packed_own_rows": [8, 12]}, out["other_loaders"]

        errors = out["errors"]
        assert errors["mesh_12"].startswith("batch of shape (12, 12) cannot be split by NamedSharding")
        assert "the batch size must be divisible by the number of batch shards" in errors["mesh_12"]
        assert errors["no_mesh_15"] == (
            "global batch_size=15 is not divisible by process_count=2; every process must hold the "
            "same number of rows (choose a batch_size that is a multiple of 2)")
