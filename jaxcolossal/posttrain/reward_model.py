"""A reward model as a GRPO reward function: ``posttrain.reward_funcs`` entry ``model:PATH``, a Hugging Face
``*ForSequenceClassification`` folder with one label (as ``training.objective=reward`` exports it,
:mod:`jaxcolossal.posttrain.reward`), scored on the training mesh's devices.

It follows TRL 1.16's ``GRPOTrainer._calculate_rewards`` for a model reward function: each prompt's text
and its completion's text are joined (``prompt + completion``), or for a chat prompt (a message list) the
conversation ``prompt + completion messages`` is rendered by the reward model's chat template (TRL's
``apply_chat_template({"messages": p + c})``: no generation prompt); the text is tokenized by the reward
model's own tokenizer with no special tokens added, right-padded with its ``pad_token_id``, and the reward
is the score head at each row's last non-pad token (transformers' pooling:
:func:`jaxcolossal.models.score_head.pooled_scores`), ``logits[:, 0]``.

The weights are sharded on the training mesh as the policy's compute params are (:func:`reward_shardings`:
the rules table, and over ``fsdp`` under ZeRO-3), so a reward model as large as the policy fits where the
policy does; the rows are split over the data axes.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.data.chat import chat_renderer
from jaxcolossal.data.tokenizer import get_tokenizer
from jaxcolossal.errors import ConfigError
from jaxcolossal.models import get_family, param_layout
from jaxcolossal.models.hf_io import load_hf
from jaxcolossal.models.layers.logprobs import no_shard
from jaxcolossal.models.score_head import SCORE, pooled_scores
from jaxcolossal.parallel.mesh import DATA_AXES
from jaxcolossal.parallel.sharding import RULES, logical_to_spec, zero_spec
from jaxcolossal.posttrain.rewards import completion_text

MODEL_PREFIX = "model:"
"""How ``posttrain.reward_funcs`` names a reward model: ``model:PATH``."""

LENGTH_BUCKET = 64
"""Rows are padded to a multiple of this many tokens, so that few lengths compile."""


class ModelReward:
    """``fn(prompts, completions, **kwargs) -> [float]``: the reward model at ``path`` (module docstring).
    ``mesh``: the training mesh (the params sharded on it by :func:`reward_shardings` with ``zero_stage``,
    the rows split over its data axes); ``None``: the default device. ``tokenizer``: the one to use when
    the folder has none (the run's: a reward model trained on the same tokenizer, e.g. ``byte``, exports
    no tokenizer file).

    Raises (construction):
        ConfigError: no such folder, not a one-label ``*ForSequenceClassification``, or no tokenizer there.
    """

    def __init__(self, path: str, mesh=None, tokenizer=None, zero_stage: int = 0):
        self.__name__ = MODEL_PREFIX + path
        self.path, self.mesh = path, mesh
        self.cfg, params = _load(path)
        self.tok = _tokenizer(path, tokenizer)
        self.pad_id = _pad_id(path, self.tok)
        self.family = get_family(self.cfg)
        self._render = None  # the chat template, parsed at the first chat prompt
        self.rows_multiple = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in DATA_AXES]))
        if mesh is not None:
            params = jax.device_put(params, reward_shardings(self.cfg, params, mesh, zero_stage))
            self._rows = NamedSharding(mesh, P(DATA_AXES))
        self.params = params
        self._score = jax.jit(self._forward)

    def _forward(self, params, tokens):
        h = self.family.hidden_states(params, tokens, self.cfg, no_shard, False, None, None)
        return pooled_scores(h, params[SCORE], tokens, self.pad_id)[:, 0]

    def tokens(self, prompts: list, completions: list) -> np.ndarray:
        """int32 ``[n', t]``: each ``prompt + completion`` text's ids, right-padded with the pad id to a
        multiple of :data:`LENGTH_BUCKET`, rows padded (with pad rows) to a multiple of the data shards.

        Raises:
            TokenizerError: a chat prompt and no chat template in the reward model's tokenizer."""
        ids = [self.tok.encode(self.text(p, c)) for p, c in zip(prompts, completions)]
        width = max(1, max(len(i) for i in ids))
        width = -(-width // LENGTH_BUCKET) * LENGTH_BUCKET
        rows = -(-len(ids) // self.rows_multiple) * self.rows_multiple
        out = np.full((rows, width), self.pad_id, np.int32)
        for r, i in enumerate(ids):
            out[r, :len(i)] = i
        return out

    def text(self, prompt, completion) -> str:
        """What the reward model reads of one row: ``prompt + completion`` text, or a chat prompt's
        conversation with the completion as the assistant's turn, rendered by the reward model's template."""
        if isinstance(prompt, str):
            return prompt + completion_text(completion)
        if self._render is None:
            self._render = chat_renderer(self.tok)
        turn = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return self._render(list(prompt) + list(turn), False)

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        tokens = self.tokens(list(prompts), list(completions))
        if self.mesh is not None:
            tokens = jax.make_array_from_callback(tokens.shape, self._rows, lambda i: tokens[i])
        scores = np.asarray(jax.device_get(self._score(self.params, jnp.asarray(tokens) if self.mesh is None
                                                       else tokens)), np.float32)
        return [float(s) for s in scores[:len(completions)]]


def reward_shardings(cfg, params, mesh, zero_stage: int = 0) -> dict:
    """``NamedSharding`` per leaf of the reward model's ``params`` on ``mesh``: the rules table's spec of the
    leaf's logical axes (:func:`jaxcolossal.models.param_layout`), with the ZeRO dimension over ``fsdp`` when
    ``zero_stage`` is 3 (:func:`jaxcolossal.parallel.sharding.zero_spec`), as the policy's compute params
    are. A dimension its mesh axes do not divide (a vocabulary that tp does not) is left whole."""
    _, _, axes = param_layout(cfg)
    shape = dict(mesh.shape)

    def spec(ax, leaf):
        s = zero_spec("reward model", ax, leaf.shape, shape, RULES) if zero_stage == 3 else logical_to_spec(ax)
        entries = tuple(s) + (None,) * (leaf.ndim - len(s))
        return NamedSharding(mesh, P(*(e if _divides(n, e, shape) else None for n, e in zip(leaf.shape, entries))))
    try:
        return jax.tree.map(spec, axes, params, is_leaf=lambda x: isinstance(x, tuple))
    except ConfigError:  # no dimension divides fsdp: the rules table's layout without ZeRO
        return reward_shardings(cfg, params, mesh, 0)


def _divides(size: int, entry, mesh_shape: dict) -> bool:
    """Whether the mesh axes of a spec ``entry`` (None, a name or a tuple of names) divide ``size``."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return size % math.prod(mesh_shape.get(a, 1) for a in names) == 0


def _load(path: str):
    """``(cfg, params)`` of the folder's one-label sequence classifier.

    Raises:
        ConfigError: as :class:`ModelReward`."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"posttrain.reward_funcs: {MODEL_PREFIX}{path}: no config.json there (a Hugging Face "
                          "*ForSequenceClassification folder, e.g. what --to-hf writes of a reward run)")
    cfg, params = load_hf(path)
    if cfg.num_labels != 1 or SCORE not in params:
        raise ConfigError(f"posttrain.reward_funcs: {MODEL_PREFIX}{path} is not a one-label sequence classifier "
                          f"(model.num_labels={cfg.num_labels}): train one with training.objective=reward")
    return cfg, params


def _tokenizer(path: str, fallback):
    """The folder's tokenizer, else ``fallback``.

    Raises:
        ConfigError: neither."""
    try:
        return get_tokenizer(path)
    except (FileNotFoundError, ValueError):
        if fallback is None:
            raise ConfigError(f"posttrain.reward_funcs: {MODEL_PREFIX}{path}: no tokenizer there") from None
        return fallback


def _pad_id(path: str, tok) -> int:
    """The folder's ``pad_token_id`` (``config.json``), else the tokenizer's end-of-text id, else 0."""
    with open(os.path.join(path, "config.json")) as f:
        pad = json.load(f).get("pad_token_id")
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    if pad is None:
        pad = getattr(tok, "eos_id", None)
    return int(pad or 0)
