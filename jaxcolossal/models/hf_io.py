"""Hugging Face folders in and out, for every registered model family: configs and safetensors weights.

Reads and writes LOCAL Hugging Face model directories (nothing is downloaded)::

    config.json
    generation_config.json                    written by save_hf when special-token ids are given
    model.safetensors                         one file, or
    model.safetensors.index.json              {"metadata": {"total_size"}, "weight_map": {key: file}}
    model-00001-of-0000N.safetensors ...

* :func:`load_hf` ``(path, tp) -> (ModelConfig, params)``: the params dict of
  :mod:`jaxcolossal.models.llama` / :mod:`jaxcolossal.models.gpt2`, fp32 numpy, the vocabulary
  padded for ``tp`` with zero rows.
* :func:`save_hf` ``(path, cfg, params, special_tokens=None)``: the inverse; the padding is
  stripped, the result loads in ``transformers`` (as the architecture it was read from: docs/models.md) with
  no missing or unexpected keys; ``special_tokens`` (bos/eos/pad ids) go into ``config.json`` and
  ``generation_config.json``.
* :func:`config_from_hf` / :func:`config_to_hf`: ``config.json`` dict <-> :class:`ModelConfig`;
  :func:`read_special_tokens`: the bos/eos/pad ids a directory names.
* :func:`init_params_from` ``(cfg_model, tp)``: the weights behind ``model.init_from`` (fine-tuning).

The key mapping of each family is in its ``hf`` module (:mod:`jaxcolossal.models.llama.hf`:
LLaMA, Mixtral, Qwen3-MoE; :mod:`jaxcolossal.models.gpt2.hf`; :mod:`jaxcolossal.models.gemma.hf`: Gemma 2,
Gemma 3), reached through the family registry
(:class:`jaxcolossal.models.family.Family`: ``hf_architectures``, ``config_from_hf``, ``params_from_hf``, ...).

Weights are read with the ``safetensors`` package's numpy API (bf16 tensors, which numpy
cannot represent, are read from the file's raw bytes) and always returned as float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models import FAMILIES, get_family
from jaxcolossal.models.family import Family
from jaxcolossal.models.score_head import SCORE, SCORE_HF_KEY, is_seqcls, seqcls_architecture, with_score_params

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Buffers that some checkpoints carry and that are not parameters.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
"""The vision tower and projector of a multimodal checkpoint, which its causal language model leaves
unused (Gemma 3's text model read from a ``Gemma3ForConditionalGeneration``: :mod:`jaxcolossal.models.gemma.hf`)."""


# ----------------------------------------------------------------------------- configs


def _hf_family(hf: dict) -> tuple[Family, str]:
    """The registered family that reads a ``config.json`` dict, and its Hugging Face ``model_type``
    (``llama``, ``gpt2``, or a mixture of experts of the LLaMA family: ``mixtral``, ``qwen3_moe``)."""
    known = {t: f for f in FAMILIES.values() for t in f.hf_architectures}
    mt = hf.get("model_type")
    if mt in known:
        return known[mt], mt
    for arch in hf.get("architectures") or []:
        for t, f in known.items():
            if arch == f.hf_architectures[t]:
                return f, t
    archs = sorted(a for f in FAMILIES.values() for a in f.hf_architectures.values())
    raise ConfigError(f"Hugging Face config: model_type={mt!r}, architectures={hf.get('architectures')}: "
                      f"supported are {sorted(known)} ({archs})")


def config_from_hf(hf: dict, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict, by the family that reads its
    ``model_type`` (each family's ``hf.config_from_hf`` lists the keys it reads). ``overrides``
    (e.g. ``vocab_pad_multiple=64``, ``remat="full"``) are set on the result.

    Raises:
        ConfigError: an unsupported architecture, or a key that changes the math and is not
            implemented, named in one line by the family's reader (a RoPE type outside transformers'
            six, non-zero dropout, another activation, MXFP4/FP8 quantisation, ...; docs/models.md;
            GPT-2: an activation other than the tanh GELU, unscaled or layer-scaled attention,
            cross-attention).
    """
    family, kind = _hf_family(hf)
    cfg = family.config_from_hf(hf, kind)
    if is_seqcls(hf):  # a *ForSequenceClassification: the score head (num_labels from id2label, as transformers)
        cfg = dataclasses.replace(cfg, num_labels=len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2)))
    return dataclasses.replace(cfg, **overrides)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict (``architectures``, ``model_type``, sizes, eps, ``dtype`` float32)
    that ``transformers`` reads back as ``cfg`` (the inverse of :func:`config_from_hf`); with a score
    head (``cfg.num_labels``) the ``*ForSequenceClassification`` architecture and its labels.

    Raises:
        ConfigError: an unknown ``cfg.type``, or a model its family's format has no key for; a score
            head on a ``model_type`` transformers has no sequence-classification class for.
    """
    out = {**get_family(cfg).config_to_hf(cfg), "dtype": "float32", "torch_dtype": "float32"}
    if cfg.num_labels:
        labels = [f"LABEL_{i}" for i in range(cfg.num_labels)]
        out.update(architectures=[seqcls_architecture(out["model_type"])],
                   id2label={str(i): n for i, n in enumerate(labels)}, label2id={n: i for i, n in enumerate(labels)})
    return out


def backbone_config(cfg: ModelConfig) -> ModelConfig:
    """The config a family's ``params_from_hf``/``params_to_hf`` read a score-head model's backbone with:
    its LM head tied (so neither reads nor writes ``lm_head.weight``); ``cfg`` itself without a score head."""
    return dataclasses.replace(cfg, tie_word_embeddings=True, num_labels=0) if cfg.num_labels else cfg


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a local HF model directory, as a dict.

    Raises:
        FileNotFoundError: ``path`` or its ``config.json`` does not exist.
    """
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{str(f)!r} does not exist (a local Hugging Face model directory is needed)")
    return json.loads(f.read_text())


def read_special_tokens(path: str | os.PathLike) -> dict:
    """The ``bos_token_id``/``eos_token_id``/``pad_token_id`` a local HF model directory names:
    each from ``generation_config.json`` (what ``generate()`` uses), else from ``config.json``;
    keys that neither file sets (or sets to null) are left out, so a directory without ids, or
    without either file, gives ``{}``.
    """
    out: dict = {}
    for name in ("config.json", GENERATION_CONFIG):  # the second wins
        f = Path(path) / name
        if f.is_file():
            d = json.loads(f.read_text())
            out.update({k: d[k] for k in SPECIAL_TOKENS if d.get(k) is not None})
    return out


# ----------------------------------------------------------------------------- safetensors I/O


def raw_tensor(file: str, key: str) -> np.ndarray:
    """A bf16 tensor read from the file's bytes (numpy has no bfloat16), as float32."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    info = header[key]
    if info["dtype"] != "BF16":
        raise TypeError(f"{file}: tensor {key!r} has dtype {info['dtype']}, which numpy cannot read")
    s, e = info["data_offsets"]
    raw = np.fromfile(file, dtype="<u2", count=(e - s) // 2, offset=8 + n + s)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def read_safetensors(path: str | os.PathLike) -> tuple[list[str], Callable[[str], np.ndarray]]:
    """``(keys, get)`` over the weights of a local HF directory: ``get(key)`` returns the tensor
    as a float32 numpy array. Reads ``model.safetensors.index.json`` (sharded) when present,
    else ``model.safetensors``.

    Raises:
        FileNotFoundError: neither file exists (``pytorch_model.bin`` is not read).
    """

    path = Path(path)
    index = path / SAFE_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / SAFE_SINGLE).exists():
        with safe_open(str(path / SAFE_SINGLE), framework="np") as f:
            weight_map = {k: SAFE_SINGLE for k in f.keys()}
    else:
        raise FileNotFoundError(f"{str(path)!r} has neither {SAFE_INDEX} nor {SAFE_SINGLE} "
                                "(save the model with save_pretrained(safe_serialization=True))")

    def get(key: str) -> np.ndarray:
        file = str(path / weight_map[key])
        with safe_open(file, framework="np") as f:
            try:
                x = f.get_tensor(key)
            except TypeError:  # bfloat16
                return raw_tensor(file, key)
        return np.asarray(x, dtype=np.float32)

    return list(weight_map), get


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '5GB', '200MiB'")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base ** power)


def save_shared(tensors: dict[str, np.ndarray], file: str | os.PathLike) -> None:
    """``safetensors.numpy.save_file`` with transformers' ``{"format": "pt"}`` metadata, readable by
    others as any file this process writes (the process's umask; safetensors' temporary file would
    leave it at 0600, unreadable to the rest of a team sharing the export)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``tensors`` to ``path`` as ``model.safetensors`` or, when larger than
    ``max_shard_size`` (bytes, or ``"5GB"``, ``"200MiB"``: HF's units), as
    ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.
    Earlier ``model*.safetensors`` files and index in ``path`` are removed first. Each file
    carries the metadata ``{"format": "pt"}`` that transformers expects. Returns the file names.
    """

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        if old.exists():
            old.unlink()
    limit = _parse_size(max_shard_size)
    shards, cur, cur_bytes = [], {}, 0
    for k, v in tensors.items():
        if cur and cur_bytes + v.nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k] = np.ascontiguousarray(v)
        cur_bytes += v.nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_shared(shards[0], path / SAFE_SINGLE)
        return [SAFE_SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_shared(shard, path / name)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = int(sum(v.nbytes for v in tensors.values()))
    (path / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
    return names


# ----------------------------------------------------------------------------- vocabulary padding


def _pad_vocab(params: dict, cfg: ModelConfig, vocab: int) -> dict:
    emb = get_family(cfg).embedding
    extra = vocab - cfg.vocab_size
    if extra:
        params[emb] = np.pad(params[emb], ((0, extra), (0, 0)))
        if "lm_head" in params:
            params["lm_head"] = np.pad(params["lm_head"], ((0, 0), (0, extra)))
    return params


# ----------------------------------------------------------------------------- public API


def load_hf(path: str | os.PathLike, tp: int = 1, **overrides: Any) -> tuple[ModelConfig, dict]:
    """Import a local Hugging Face directory of any registered family's architecture (docs/models.md).

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``); nothing is downloaded.
        tp: tensor-parallel size: the vocabulary is padded with zero rows (and zero ``lm_head``
            columns) to ``padded_vocab_size(cfg, tp)``; the padded logits are masked.
        overrides: :class:`ModelConfig` fields to set on the imported config
            (``vocab_pad_multiple=64``, ``remat="full"``, ...).

    Returns:
        ``(cfg, params)``: the config, and the params dict of the family's
        ``param_shapes_and_axes`` (module doc of :mod:`jaxcolossal.models.hf_io` for the key
        mapping) as float32 numpy arrays; ``jax.device_put``/``init_state(params=...)`` shard it.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors weights.
        ConfigError: an unsupported architecture or feature (:func:`config_from_hf`).
        KeyError: a weight that the architecture needs is missing from the checkpoint.
        ValueError: the checkpoint has weights this mapping does not use, or a weight has the
            wrong shape (both mean the checkpoint is not the architecture its config names).
    """

    cfg = config_from_hf(read_hf_config(path), **overrides)
    keys, get = read_safetensors(path)
    keyset = set(keys)

    def checked_get(key):
        if key not in keyset:
            raise KeyError(f"{str(path)!r}: weight {key!r} is missing from the checkpoint")
        return get(key)

    family = get_family(cfg)
    params, used = family.params_from_hf(checked_get, keyset.__contains__, backbone_config(cfg))
    if cfg.num_labels:  # a sequence-classification checkpoint: score.weight [num_labels, d], no lm_head
        params[SCORE] = checked_get(SCORE_HF_KEY).T
        used.add(SCORE_HF_KEY)
    unused = sorted(k for k in keyset - used if not (_IGNORED.search(k) or _TOWERS.search(k)))
    if unused:
        arch = config_to_hf(cfg)["architectures"][0]
        raise ValueError(f"{str(path)!r}: the checkpoint has weights that a {arch} of this "
                         f"config does not use: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    vocab = family.padded_vocab_size(cfg, tp)
    params = _pad_vocab(params, cfg, vocab)
    want = family.param_shapes_and_axes(cfg, vocab)
    flat = [(n, sa, params[n]) for n, sa in want.items() if not isinstance(sa, dict)]
    flat += [(f"{s}.{n}", sa, params[s][n]) for s, stack in want.items() if isinstance(stack, dict)
             for n, sa in stack.items()]  # the stacks of layers: layers, and DeepSeek's dense_layers
    for name, (shape, _), got in flat:
        if tuple(got.shape) != tuple(shape):
            raise ValueError(f"{str(path)!r}: {name} has shape {tuple(got.shape)}, the config implies {tuple(shape)}")
    return cfg, params


def check_special_tokens(special_tokens: dict, vocab_size: int) -> dict:
    """``special_tokens`` checked against a vocabulary of ``vocab_size`` entries: keys among
    ``bos_token_id, eos_token_id, pad_token_id``, values an id in ``[0, vocab_size)``, a list of
    such ids (several end tokens, as LLaMA-3's ``generation_config.json`` has), or None.
    Returns a copy with plain ``int`` ids.

    Raises:
        ConfigError: an unknown key, or an id that is not an integer or lies outside the vocabulary.
    """
    out = {}
    for key, value in special_tokens.items():
        if key not in SPECIAL_TOKENS:
            raise ConfigError(f"special token {key!r}: expected one of {', '.join(SPECIAL_TOKENS)}")
        if value is None:
            out[key] = None
            continue
        many = isinstance(value, (list, tuple))
        ids = list(value) if many else [value]
        if not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
            raise ConfigError(f"{key}={value!r}: expected a token id (an integer), a list of them, or None")
        for i in ids:
            if not 0 <= int(i) < vocab_size:
                raise ConfigError(f"{key}={int(i)} lies outside the model's vocabulary (model.vocab_size="
                                  f"{vocab_size}: ids 0..{vocab_size - 1})")
        out[key] = [int(i) for i in ids] if many else int(value)
    return out


def hf_tensors(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{Hugging Face key: fp32 numpy}`` of ``params`` (jax or numpy, fully addressable) by the family's
    key mapping, the vocabulary padding stripped; a score head (``cfg.num_labels``) as ``score.weight``
    ``[num_labels, d]`` beside the backbone's keys (no ``lm_head.weight``)."""
    family = get_family(cfg)
    p = jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), params)
    emb = family.embedding
    p[emb] = p[emb][: cfg.vocab_size]
    if "lm_head" in p:
        p["lm_head"] = p["lm_head"][:, : cfg.vocab_size]
    score = p.pop(SCORE, None)
    tensors = family.params_to_hf(p, backbone_config(cfg))
    if cfg.num_labels:
        tensors[SCORE_HF_KEY] = np.ascontiguousarray(score.T)
    return tensors


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params: Any, max_shard_size: int | str = "5GB",
            special_tokens: dict | None = None) -> list[str]:
    """Export ``params`` as a Hugging Face model directory that ``transformers`` loads
    (``AutoModelForCausalLM.from_pretrained(path)``) with no missing or unexpected keys.

    Args:
        path: output directory (created); earlier ``model*.safetensors`` files in it are removed.
        cfg: the model config (any registered ``type``).
        params: the params dict (jax or numpy arrays, any float dtype, fully addressable from
            this process, e.g. ``state.params`` or ``state.master``); written as float32.
            Vocabulary padding is removed: rows/columns beyond ``cfg.vocab_size`` are dropped.
        max_shard_size: bytes or HF-style ``"5GB"``/``"200MiB"``; a larger model is written as
            shards plus ``model.safetensors.index.json``.
        special_tokens: ``{"bos_token_id": int | None, "eos_token_id": ..., "pad_token_id": ...}``
            (any of the keys; :func:`check_special_tokens`): written into ``config.json`` (None as
            ``null``), and the ids that are set into ``generation_config.json`` as
            ``transformers.GenerationConfig.save_pretrained`` writes it (``"_from_model_config":
            true``), so that ``generate()`` stops at ``eos_token_id``. None: ``config.json`` carries
            only :func:`config_to_hf`'s ids (``transformers`` assumes its own defaults for the
            rest) and no ``generation_config.json`` is written.

    Writes ``config.json`` (:func:`config_to_hf`, plus the ids), the safetensors file(s) (module
    doc for the key names; tied embeddings are written once, as HF does) and, when ids are set,
    ``generation_config.json``; an earlier ``generation_config.json`` in ``path`` is removed
    otherwise. Returns the weight file names. A reward model (``cfg.num_labels``) is written as its
    family's ``*ForSequenceClassification`` (``AutoModelForSequenceClassification.from_pretrained``:
    ``score.weight``, no ``lm_head``, ``id2label``), which needs ``pad_token_id``; no
    ``generation_config.json`` (it does not generate).

    Raises:
        ConfigError: an unknown ``cfg.type``; a special-token id outside ``[0, cfg.vocab_size)``
            or an unknown key in ``special_tokens``; a score head without ``pad_token_id``, or on an
            architecture transformers has no sequence-classification class for (nothing is written then).
    """

    get_family(cfg)  # an unknown type is refused before anything is written
    ids = check_special_tokens(special_tokens, cfg.vocab_size) if special_tokens is not None else None
    if cfg.num_labels and (ids or {}).get("pad_token_id") is None:
        raise ConfigError("a score-head model (model.num_labels=1) exports as a sequence-classification model, "
                          "which needs pad_token_id (transformers reads the score at the last non-pad token)")
    tensors = hf_tensors(params, cfg)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config_to_hf(cfg), **(ids or {})}, indent=2) + "\n")
    generation = {k: v for k, v in (ids or {}).items() if v is not None and not cfg.num_labels}  # none: no generate()
    if generation:
        (path / GENERATION_CONFIG).write_text(
            json.dumps({"_from_model_config": True, **dict(sorted(generation.items()))}, indent=2) + "\n")
    elif (path / GENERATION_CONFIG).exists():
        (path / GENERATION_CONFIG).unlink()
    return write_safetensors(path, tensors, max_shard_size)


# Fields that must agree between the YAML and the HF config for ``model.init_from``.
_MATCH = ("type", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "vocab_size", "tie_word_embeddings")


def check_init_from(cfg_model: ModelConfig) -> None:
    """Check ``model.init_from`` before anything compiles: the directory and its ``config.json``
    exist and describe the model of the YAML (the keys listed in :func:`init_params_from`).

    Raises:
        ConfigError: a missing directory or config (naming the key), an unsupported HF config,
            or sizes that differ (every mismatched key with both values).
    """
    path = cfg_model.init_from
    try:
        hf = config_from_hf(read_hf_config(path))
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from={path!r}: {e}") from None
    if hf.num_labels and not cfg_model.num_labels:
        raise ConfigError(f"model.init_from={path!r} is a sequence-classification checkpoint (a score head, no "
                          "lm_head): it trains only as a reward model (training.objective=reward)")
    bad = model_mismatches(cfg_model, hf, "the Hugging Face config")
    if bad:
        raise ConfigError(f"model.init_from={path!r}: the model section does not match the checkpoint: "
                          + "; ".join(bad))


def model_mismatches(cfg_model: ModelConfig, other: ModelConfig, whose: str) -> list[str]:
    """The architecture keys (``type``, the sizes, the vocabulary, tied embeddings and the family's
    ``init_from_keys``) on which ``other`` differs from ``cfg_model``, each as ``model.<key>=<ours>
    (<whose> has <theirs>)``; empty when the two models have the same weights' layout and meaning."""
    keys = _MATCH + get_family(other).init_from_keys
    bad = []
    for k in keys:
        a, b = getattr(cfg_model, k), getattr(other, k)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            bad.append(f"model.{k}={a!r} ({whose} has {b!r})")
    return bad


def repad_vocab(params: dict, cfg_model: ModelConfig, tp: int = 1) -> dict:
    """``params`` (numpy, any vocabulary padding) with the embedding rows (and ``lm_head`` columns) past
    ``cfg_model.vocab_size`` dropped, then padded with zeros to ``padded_vocab_size(cfg_model, tp)``: a
    checkpoint's weights in the padding of a run of ``cfg_model`` on tp ``tp``."""
    emb = get_family(cfg_model).embedding
    params = dict(params)
    params[emb] = np.asarray(params[emb])[: cfg_model.vocab_size]
    if "lm_head" in params:
        params["lm_head"] = np.asarray(params["lm_head"])[:, : cfg_model.vocab_size]
    return _pad_vocab(params, cfg_model, get_family(cfg_model).padded_vocab_size(cfg_model, tp))


def init_params_from(cfg_model: ModelConfig, tp: int = 1, seed: int = 0) -> dict | None:
    """The initial params for ``model.init_from`` (fine-tuning from Hugging Face weights).

    Returns ``None`` when ``cfg_model.init_from`` is empty; else :func:`load_hf` of that
    directory, padded with ``cfg_model.vocab_pad_multiple`` and ``tp`` (fp32 numpy, for
    ``init_state(plan, tx, params=...)``). A reward model (``cfg_model.num_labels``) from a causal
    LM's checkpoint drops its ``lm_head`` and draws the score head from ``normal(0,
    initializer_range)`` with ``jax.random.key(seed)`` (:func:`jaxcolossal.models.score_head.init_score`,
    as transformers initialises the ``score`` a causal-LM checkpoint lacks); a sequence-classification
    checkpoint's ``score.weight`` is loaded.

    The YAML must describe the same model: ``type, num_layers, hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings`` and, for llama,
    ``rms_norm_eps, rope_theta``, for gpt2 ``max_position_embeddings, layer_norm_eps`` must equal
    the HF config's (checked by :func:`check_init_from` before any weight is read).

    Raises:
        ConfigError: see :func:`check_init_from`.
        FileNotFoundError: no weights in the directory.
    """
    if not cfg_model.init_from:
        return None
    check_init_from(cfg_model)
    _, params = load_hf(cfg_model.init_from, tp, vocab_pad_multiple=cfg_model.vocab_pad_multiple)
    if cfg_model.num_labels and SCORE not in params:
        params = with_score_params(params, cfg_model, jax.random.key(seed))
        params[SCORE] = np.asarray(params[SCORE])
    return params
