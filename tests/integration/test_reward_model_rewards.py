"""A reward model as GRPO's reward (``posttrain.reward_funcs=model:PATH``): a tiny one-label
``LlamaForSequenceClassification`` saved by transformers over the byte vocabulary scores ``prompt +
completion`` on the training mesh as transformers scores the same ids (within 1e-5), a folder that is not
one is refused in one line, and a GRPO run that takes it as its reward raises it."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from hf_tiny import tiny_llama  # noqa: E402
from test_grpo_train import grpo_config, run_grpo  # noqa: E402
from test_reward_trl_parity import tiny_reward_model  # noqa: E402
from tokenizer_families import build  # noqa: E402
from trl.data_utils import apply_chat_template  # noqa: E402

from jaxcolossal.config import ConfigError  # noqa: E402
from jaxcolossal.data import get_tokenizer  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.posttrain.reward_model import ModelReward  # noqa: E402

def _save_reward_model(path, seed=0):
    """A tiny byte-vocabulary reward model (``pad_token_id`` 0), saved; returned in eval mode."""
    model = tiny_reward_model(seed, vocab=256, positions=256)
    model.save_pretrained(str(path))
    return model.eval()


LAYOUTS = {"zero2-dp4-tp2": ({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2}, "tp"),
           "zero3-fsdp8": ({"data_parallel_size": 8, "zero_stage": 3}, "fsdp")}
"""Each: the training layout, and the mesh axis its attention weights are split over there."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_reward_model_scores_as_transformers_on_the_training_mesh(tmp_path, layout):
    """The training mesh (8 devices, the rows over the data axes, the weights sharded as the policy's): 6
    prompt + completion texts of mixed lengths, each score within 1e-5 of transformers' on the same
    right-padded byte ids."""
    hf = _save_reward_model(tmp_path / "rm")
    parallel, axis = LAYOUTS[layout]
    cfg = grpo_config(parallel)
    fn = ModelReward(str(tmp_path / "rm"), make_mesh(cfg.parallel), get_tokenizer("byte"), cfg.parallel.zero_stage)
    split = [leaf.sharding.spec for leaf in jax.tree.leaves(fn.params)]
    assert any(axis in str(spec) for spec in split), split  # not a replicated copy
    prompts = ["1+2=", "13+4=", "7+7=", "2+2=", "19+1=", "5+0="]
    completions = ["3", "17\n", "14 is it", "5", "20", ""]
    got = np.asarray(fn(prompts=prompts, completions=completions), np.float64)
    tokens = fn.tokens(prompts, completions)
    assert tokens.shape[0] % 4 == 0 and tokens.shape[1] % 64 == 0
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(tokens[:6].astype(np.int64))).logits[:, 0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.ptp(got) > 0.01  # the scores differ: the check is not of a constant


def test_a_folder_that_is_not_a_reward_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.json there"):
        grpo_config(posttrain={"reward_funcs": f"model:{tmp_path}/none", "reward_weights": ""})
    tiny_llama(0, 256).save_pretrained(str(tmp_path / "lm"))
    with pytest.raises(ConfigError, match="is not a one-label sequence classifier"):
        ModelReward(str(tmp_path / "lm"), None, get_tokenizer("byte"))


def test_grpo_raises_a_reward_models_score(tmp_path):
    """40 GRPO steps (learning rate 1e-2) on one device with the reward model as the only reward: the mean
    reward of the last 10 steps is above the first 10's by more than twice its standard error."""
    _save_reward_model(tmp_path / "rm")
    cfg = grpo_config(posttrain={"reward_funcs": f"model:{tmp_path}/rm", "reward_weights": "",
                                 "num_iterations": 1, "beta": 0.0, "epsilon_high": 0.0})
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, learning_rate=1e-2, max_steps=40))
    _, out = run_grpo(cfg, jax.devices()[:1], steps=40)
    rewards = np.asarray([m["reward"] for _, m in out])
    print("reward per step:", np.round(rewards, 3))
    first, last = rewards[:10], rewards[-10:]
    print(f"first 10 steps {first.mean():.3f} ± {first.std() / np.sqrt(10):.3f}, last 10 {last.mean():.3f} ± "
          f"{last.std() / np.sqrt(10):.3f}")
    assert last.mean() - first.mean() > 2 * np.hypot(first.std(), last.std()) / np.sqrt(10), rewards


def test_a_chat_prompt_is_scored_as_trl_renders_it(tmp_path):
    """Chat prompts (message lists) on ZeRO-2 dp 4 × tp 2: the conversation ``prompt + completion`` rendered by
    the reward model's chat template (a Qwen2.5-shaped tokenizer folder) scores within 1e-5 of TRL 1.16's
    ``_calculate_rewards`` path (``trl.data_utils.apply_chat_template({"messages": p + c})``, the tokenizer
    right-padding without special tokens, transformers' model)."""
    info = build("qwen2_5", tmp_path / "tok")
    assert info["template"]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    hf = tiny_reward_model(0, vocab=len(tok), positions=256)
    hf.config.pad_token_id = tok.pad_token_id  # the folder's pad, as a trained reward model's config holds it
    hf.save_pretrained(str(tmp_path / "rm"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, tmp_path / "rm" / name)
    prompts = [[{"role": "user", "content": q}] for q in ("What is 12 + 30?", "Hello there.", "Say hi", "7 * 6?")]
    prompts[1] = [{"role": "system", "content": "You are a helpful assistant."}] + prompts[1]
    completions = [[{"role": "assistant", "content": a}] for a in ("42", "Hello world! How are you?", "hi", "")]
    cfg = grpo_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2})
    fn = ModelReward(str(tmp_path / "rm"), make_mesh(cfg.parallel), None, cfg.parallel.zero_stage)
    got = np.asarray(fn(prompts=prompts, completions=completions), np.float64)
    texts = [apply_chat_template({"messages": p + c}, tok)["text"] for p, c in zip(prompts, completions)]
    assert [fn.text(p, c) for p, c in zip(prompts, completions)] == texts
    enc = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        want = hf.eval()(**enc).logits[:, 0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.ptp(got) > 0.01
