"""Config loading and validation: every bad input gets a clear error before compilation."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from jaxcolossal.config import (
    RANGES,
    Config,
    ConfigError,
    ParallelConfig,
    all_keys,
    config_from_dict,
    load_config,
    validate,
)
from jaxcolossal.config.schema import AutoFloat
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.plan import dp_gradient_bytes, dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "llama_tiny.yaml")  # the default config of scripts/train.py


def test_default_config_loads_and_overrides_apply():
    cfg = load_config("configs/llama_tiny.yaml", ["parallel.zero_stage=3", "training.learning_rate=1e-4",
                                                 "training.max_steps=50", "precision.bf16=true"])
    assert cfg.parallel.zero_stage == 3
    assert cfg.training.learning_rate == pytest.approx(1e-4)
    assert isinstance(cfg.training.learning_rate, float)
    assert cfg.training.max_steps == 50
    assert cfg.precision.mode == "bf16"
    assert cfg.model.num_layers == 4


def test_unknown_key_names_the_key_and_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'training.batchsize'.*allowed keys: \[.*'batch_size'"):
        config_from_dict({"training": {"batchsize": 4}})
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer' in the top level"):
        config_from_dict({"optimizer": {}})
    with pytest.raises(ConfigError, match="unknown key 'parallel.tp'"):
        config_from_dict({}, ["parallel.tp=2"])


def test_wrong_types_and_literals():
    with pytest.raises(ConfigError, match=r"training.batch_size='many': expected an integer"):
        config_from_dict({"training": {"batch_size": "many"}})
    with pytest.raises(ConfigError, match=r"parallel.zero_stage=4: allowed values are \[0, 1, 2, 3\]"):
        config_from_dict({}, ["parallel.zero_stage=4"])
    with pytest.raises(ConfigError, match="precision.bf16=1: expected true or false"):
        config_from_dict({"precision": {"bf16": 1}})
    with pytest.raises(ConfigError, match="choose one"):
        config_from_dict({"precision": {"bf16": True, "fp16": True}})


def test_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide model.num_attention_heads=4"):
        config_from_dict({"parallel": {"tensor_parallel_size": 3}})
    # kv heads: 4 heads / 2 kv heads, tp=4 divides the heads but not the kv heads
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide model.num_key_value_heads=2"):
        config_from_dict({"parallel": {"tensor_parallel_size": 4}})


def test_mesh_product_must_match_device_count():
    par = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"2×2×1 = 4, but there are 8 devices"):
        make_mesh(par)
    with pytest.raises(ConfigError, match=r"\(tensor_parallel_size=3\) multiply to 3, which does not divide the 8 "
                                          r"devices; their product must be one of \[1, 2, 4, 8\]"):
        ParallelConfig(data_parallel_size=-1, tensor_parallel_size=3).resolve(8)
    with pytest.raises(ConfigError, match="at most one"):
        ParallelConfig(data_parallel_size=-1, tensor_parallel_size=-1).resolve(8)
    assert ParallelConfig(data_parallel_size=-1, tensor_parallel_size=2).resolve(8).data_parallel_size == 4


def test_batch_must_split_over_data_group_and_microbatches():
    cfg = config_from_dict({"training": {"batch_size": 12, "gradient_accumulation_steps": 3}})
    with pytest.raises(ConfigError, match="microbatch of training.batch_size / gradient_accumulation_steps = 4 "
                                          "sequences is not divisible by the data-parallel size 8"):
        validate(cfg, num_devices=8)
    with pytest.raises(ConfigError, match="not divisible by training.gradient_accumulation_steps=5"):
        config_from_dict({"training": {"batch_size": 16, "gradient_accumulation_steps": 5}})


def test_zero_needs_hidden_divisible():
    cfg = config_from_dict({"model": {"hidden_size": 132, "num_attention_heads": 6, "num_key_value_heads": 6},
                            "parallel": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match="hidden_size=132 is not divisible by data_parallel_size=8"):
        validate(cfg, num_devices=8)


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")


def test_80_layer_example_validates_and_plans():
    cfg = load_config("configs/llama_80l_example.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (80, 12288, 96)
    assert (cfg.parallel.zero_stage, cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size) == (3, 8, 4)
    assert cfg.precision.fp16 and cfg.precision.fp16_opt_level == "O2"
    text = dry_run(cfg)
    assert "parameters 111,518,035,968" in text  # 80 layers of d=12288, f=28672, GQA 96/8, vocab 32000
    assert "mesh {'pp': 4, 'dp': 1, 'fsdp': 1, 'ep': 1, 'sp': 1, 'tp': 8}" in text
    assert cfg.training.batch_size == 16  # micro_batch_size 1 × 16 accumulation steps × dp 1
    assert "per-device model state" in text
    assert "comm       data-parallel gradients over 1: reduce-scatter in fp32, 0.00 MiB" in text


def test_dry_run_names_the_gradient_communication():
    """The dry run's ``comm`` line: the reduction's kind, its options and the planner's bytes."""
    base = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                      "vocab_size": 256, "max_position_embeddings": 32},
            "training": {"batch_size": 8, "seq_len": 32, "adam_freeze_step": 10}}
    cfg = config_from_dict({**base, "parallel": {"data_parallel_size": 8, "zero_stage": 0, "gradient_compression": "topk",
                                                 "momentum_correction": True, "compression_warmup_steps": 10}})
    line = [x for x in dry_run(cfg).splitlines() if x.startswith("comm")][0]
    mib = dp_gradient_bytes(cfg, 8) / 2**20
    assert line == ("comm       data-parallel gradients over 8: top-k 0.01 with error feedback and momentum correction "
                    f"after 10 dense steps, {mib:,.2f} MiB sent per device per step")
    cfg = config_from_dict({**base, "parallel": {"data_parallel_size": 8, "zero_stage": 3, "communication_dtype": "fp8"}})
    assert ("reduce-scatter in fp8" in dry_run(cfg)) and ("ZeRO-3 layer weights gathered in fp8" in dry_run(cfg))


# ----------------------------------------------------------------------------- values that make no sense


def _numeric_keys():
    out = {}
    for key in all_keys():
        ann = Config
        for name in key.split("."):  # nested sections (model.lora.rank)
            ann = typing.get_type_hints(ann)[name]
        if ann in (int, float):
            out[key] = ann
        elif ann is AutoFloat:  # a number or "auto": its numbers have a range like a float's
            out[key] = float
    assert dataclasses.is_dataclass(Config) and len(out) > 40
    return out


def test_every_numeric_key_has_a_range():
    assert set(_numeric_keys()) == set(RANGES)


@pytest.mark.parametrize("key", sorted(_numeric_keys()))
def test_sweep_zero_negative_nan_inf(key):
    """Each numeric key: values outside its range are refused by load_config naming the key; values
    inside it are accepted (or refused for another key's sake, never this one's)."""
    rng, ann = RANGES[key], _numeric_keys()[key]
    values = [0, -1, -2] + ([float("nan"), float("inf"), float("-inf")] if ann is float else [])
    for v in values:
        text = {float("nan"): ".nan", float("inf"): ".inf", float("-inf"): "-.inf"}.get(v, str(v)) if ann is float \
            else str(v)
        if rng.contains(v):
            try:
                config_from_dict({}, [f"{key}={text}"])
            except ConfigError as e:
                assert not str(e).startswith(f"{key}="), e
        else:
            with pytest.raises(ConfigError, match=rf"^{key}=\S+: must be"):
                config_from_dict({}, [f"{key}={text}"])


def test_float_strings_from_yaml_are_numbers(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  learning_rate: 1e-4\n  adam_eps: 1E-8\n")  # PyYAML reads these as strings
    cfg = load_config(f)
    assert cfg.training.learning_rate == 1e-4 and cfg.training.adam_eps == 1e-8
    with pytest.raises(ConfigError, match="training.learning_rate='fast': expected a number"):
        config_from_dict({"training": {"learning_rate": "fast"}})


def test_nonsense_values_named_by_key():
    for override, message in [("logging.log_every=0", "logging.log_every=0: must be >= 1"),
                              ("training.eval_batches=0", "training.eval_batches=0: must be >= 1"),
                              ("training.learning_rate=nan", "training.learning_rate=nan: must be a finite number > 0"),
                              ("training.learning_rate=inf", "training.learning_rate=inf: must be a finite number > 0"),
                              ("precision.max_consecutive_skips=0", "precision.max_consecutive_skips=0: must be >= 1")]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
            config_from_dict({}, [override])


def test_paths_expand_home_and_variables(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    cfg = config_from_dict({}, ["checkpoint.dir=~/ckpt", "logging.run_dir=$SCRATCH/runs",
                                "model.init_from=${SCRATCH}/hf", "data.corpus=~/a/*.txt, $SCRATCH/b/**/*.jsonl"])
    home = os.path.expanduser("~")
    assert cfg.checkpoint.dir == f"{home}/ckpt" and cfg.logging.run_dir == "/scratch/me/runs"
    assert cfg.model.init_from == "/scratch/me/hf"
    assert cfg.data.corpus == f"{home}/a/*.txt,/scratch/me/b/**/*.jsonl"
    assert config_from_dict({}).data.corpus == "stdlib"
    monkeypatch.delenv("NOPE", raising=False)
    with pytest.raises(ConfigError, match=r"checkpoint.dir='\$NOPE/x': the environment variable NOPE is not set"):
        config_from_dict({}, ["checkpoint.dir=$NOPE/x"])


def test_resume_values():
    assert config_from_dict({}, ["training.resume=auto", "checkpoint.dir=x"]).training.resume == "auto"
    with pytest.raises(ConfigError, match=r"training.resume='maybe': allowed values are \[false, true, auto\]"):
        config_from_dict({}, ["training.resume=maybe"])
    with pytest.raises(ConfigError, match="training.resume=true needs checkpoint.dir"):
        config_from_dict({}, ["training.resume=true"])


def test_unknown_keys_suggest_the_right_one():
    for override, guess in [("training.learnig_rate=1", "training.learning_rate"),
                            ("training.zero_stage=2", "parallel.zero_stage"),
                            ("parallel.tp=2", "parallel.tensor_parallel_size"),
                            ("model.hiden_size=8", "model.hidden_size")]:
        with pytest.raises(ConfigError, match=f"did you mean '{guess}'"):
            config_from_dict({}, [override])


def test_mesh_mismatch_suggests_devices_flag():
    with pytest.raises(ConfigError, match=r"1×1×1 = 1, but there are 8 devices.*--devices 1"):
        ParallelConfig(data_parallel_size=1).resolve(8)


def test_sizes_that_do_not_divide_the_devices_name_the_overrides_that_do():
    # issue 45 item 3: the default config (tensor_parallel_size 2, data_parallel_size -1) on 1 device
    cfg = load_config(TINY)
    with pytest.raises(ConfigError, match=r"one of \[1\]: set parallel.tensor_parallel_size=1$"):
        validate(cfg, num_devices=1)
    validate(load_config(TINY, ["parallel.tensor_parallel_size=1"]), num_devices=1)  # the named fix works
    with pytest.raises(ConfigError, match=r"set parallel.tensor_parallel_size=2 parallel.pipeline_parallel_size=1$"):
        ParallelConfig(data_parallel_size=-1, tensor_parallel_size=4, pipeline_parallel_size=2).resolve(6)
    # no -1: data_parallel_size=-1 and every other size that does not divide the devices
    with pytest.raises(ConfigError, match=r"7 devices; set parallel.data_parallel_size=-1 "
                                          r"parallel.tensor_parallel_size=1 to use them all, or"):
        ParallelConfig(data_parallel_size=4, tensor_parallel_size=2).resolve(7)


def test_train_on_one_device_with_the_default_config_names_the_override_in_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "scripts/train.py", "--devices", "1", "training.max_steps=2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("set parallel.tensor_parallel_size=1"), r.stderr


def test_broken_yaml_is_a_config_error_with_its_place(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  learning_rate: [1\n")
    with pytest.raises(ConfigError, match=r"c.yaml' is not valid YAML: .* at line 3, column 1"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"override 'training.learning_rate=\[1': the value is not valid YAML"):
        config_from_dict({}, ["training.learning_rate=[1"])
