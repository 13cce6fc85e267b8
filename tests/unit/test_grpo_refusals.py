"""Late or unclear GRPO refusals (issue 54, item 19): the batch a num_generations refusal suggests passes
every check; an empty prompts file is called empty. (``generate(mesh=...)`` with a batch the data shards do
not divide was fixed for issue 50: tests/unit/test_generate.py::test_a_batch_the_data_axes_do_not_divide_is_padded_and_the_pads_dropped.)"""

import os
import re

import pytest

from jaxcolossal.config import ConfigError, load_config, validate
from jaxcolossal.config.schema import DataConfig
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = ["training.objective=grpo", "data.format=prompts", f"data.corpus={ROOT}/configs/data/arith_prompts.jsonl",
        "data.tokenizer=byte", "model.vocab_size=256", "training.seq_len=12", "posttrain.max_completion_length=4"]


def _suggested(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), GRPO + overrides)
    assert "\n" not in str(e.value)
    return int(re.search(r"e\.g\. training\.batch_size=(\d+) ", str(e.value))[1]), str(e.value)


@pytest.mark.parametrize("overrides, want", [
    (["training.batch_size=64", "posttrain.num_generations=3"], 192),  # 63 was suggested, and refused by dp 4
    (["training.batch_size=64", "posttrain.num_generations=3", "parallel.data_parallel_size=4"], 60),
    (["training.batch_size=18", "posttrain.num_generations=4"], 16),
    (["training.batch_size=64", "posttrain.num_generations=3", "training.gradient_accumulation_steps=2"], 192),
])
def test_the_suggested_batch_passes_every_check(overrides, want):
    value, message = _suggested(overrides)
    assert value == want, message
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), GRPO + overrides + [f"training.batch_size={value}"])
    validate(cfg, num_devices=8)  # the main job's 8 devices (tp 2: a data-parallel group of 4)


def test_an_empty_prompts_file_is_called_empty(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n")
    with pytest.raises(DataError) as e:
        load_prompts(DataConfig(corpus=str(tmp_path / "p.jsonl")), get_tokenizer("byte"), 8)
    assert "hold no prompt row" in str(e.value) and "skip_long_examples" not in str(e.value), str(e.value)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a long prompt"}\n')
    with pytest.raises(DataError, match=r"data.skip_long_examples dropped all 1\); raise training.seq_len"):
        load_prompts(DataConfig(corpus=str(tmp_path / "p.jsonl"), skip_long_examples=True), get_tokenizer("byte"), 8)
