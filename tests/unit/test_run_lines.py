"""The start-up lines of a run (issue 45 item 1): the learning rate, its schedule, seq_len and the
global batch in tokens are stated, and a fine-tuning run (``model.init_from``) left at the
schema's pre-training learning rate gets one warning naming the rates and the key to set."""

from jaxcolossal.config import config_from_dict
from jaxcolossal.train.start_lines import fine_tuning_warning, init_from_inherits, optimization_line


def _cfg(model=None, **training):
    return config_from_dict({"model": model or {}, "training": {"seq_len": 64, "batch_size": 8, **training}})


def test_the_start_up_line_states_lr_schedule_seq_len_tokens_and_steps():
    line = optimization_line(_cfg(learning_rate=2e-5, warmup_steps=9, max_steps=300, min_learning_rate_ratio=0.0,
                                  weight_decay=0.0))
    assert "learning rate 2e-05" in line
    assert "warmup 9 steps, cosine decay to 0 at step 300" in line
    assert "weight decay 0" in line
    assert "seq_len 64 tokens" in line
    assert "global batch 8 sequences = 512 tokens" in line
    assert "300 steps" in line


def test_init_from_at_the_pre_training_learning_rate_warns():
    said = fine_tuning_warning(_cfg({"init_from": "HF_DIR"}))
    assert said is not None
    assert "pre-training default 0.003" in said and "set training.learning_rate" in said
    assert "1e-5 to 2e-5" in said and "1e-4 to 2e-4" in said
    lora = fine_tuning_warning(_cfg({"init_from": "HF_DIR", "lora": {"rank": 8}}))
    assert "1e-4 to 2e-4 for LoRA" in lora


def test_no_warning_without_init_from_or_with_a_learning_rate_set():
    assert fine_tuning_warning(_cfg()) is None  # pre-training at its own default
    assert fine_tuning_warning(_cfg({"init_from": "HF_DIR"}, learning_rate=2e-5)) is None
    assert fine_tuning_warning(_cfg({"init_from": "HF_DIR", "lora": {"rank": 8}}, learning_rate=1e-4)) is None


def test_init_from_says_what_is_inherited_and_what_starts_fresh():
    full = init_from_inherits(_cfg({"init_from": "HF_DIR", "num_layers": 2}))
    assert full == "its 2 layers' weights, embeddings and head; the optimizer state, the schedule and the step start fresh"
    lora = init_from_inherits(_cfg({"init_from": "HF_DIR", "num_layers": 2, "lora": {"rank": 8}}))
    assert lora.endswith("the LoRA adapters, the optimizer state, the schedule and the step start fresh")
