"""Convert between Hugging Face model directories and jaxcolossal params files (LLaMA, GPT-2,
Mixtral, Qwen3-MoE; a LoRA run's adapters in PEFT's format).

    python scripts/convert_hf.py --to-jax HF_DIR OUT [--tp 2 --vocab-pad-multiple 64]
    python scripts/convert_hf.py --to-hf  CHECKPOINT_DIR OUT [--step N] [--max-shard-size 5GB] [--tokenizer DIR]
    python scripts/convert_hf.py --to-hf  IN OUT   # IN holds params.npz + model.yaml
    python scripts/convert_hf.py --to-hf  LORA_CHECKPOINT_DIR OUT [--merge-lora]

``--to-jax`` reads a LOCAL Hugging Face directory — ``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json`` of a ``LlamaForCausalLM``, ``GPT2LMHeadModel``,
``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM``
(fp32, fp16 or bf16) — and writes, in the directory OUT:

* ``params.npz``: the params dict (float32 numpy, vocabulary padded for ``--tp`` /
  ``--vocab-pad-multiple``), one array per parameter, named by its path joined with ``/``
  (``embed_tokens``, ``layers/wq``, ...; see ``jaxcolossal.models.llama`` / ``gpt2``);
* ``model.yaml``: the ``model:`` section of a jaxcolossal config for those weights, and a
  ``training:`` section of full-SFT defaults (:func:`fine_tuning_training`: learning rate 2e-5, no
  weight decay, a 3% warmup and a cosine decay to 0, ``seq_len`` = min(max_position_embeddings,
  2048)) in place of the schema's byte-level pre-training ones (3e-3, 0.1, 10%, 128 tokens), with
  a comment saying so and that LoRA runs want ``training.learning_rate=1e-4`` to ``2e-4``;
* ``generation_config.json``: copied from HF_DIR when it has one (its special-token ids, for a
  later ``--to-hf`` of OUT).

``--to-hf`` reads a training run's ``checkpoint.dir`` directly (the newest step, or ``--step``;
fp32 master weights in bf16/fp16 runs; the model config saved with the checkpoint), or that
pair (``IN/params.npz`` + ``IN/model.yaml``), and writes a Hugging Face directory:
``config.json`` plus ``model.safetensors`` (float32), or shards plus
``model.safetensors.index.json`` above ``--max-shard-size``; the vocabulary padding is removed, and
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it with no missing or unexpected
keys.

``--to-hf`` also writes the special-token ids (``bos_token_id``, ``eos_token_id``,
``pad_token_id``) into ``config.json`` and ``generation_config.json``, so that ``generate()``
stops at the end-of-text token. They come from the first of:

1. ``--tokenizer DIR``, a Hugging Face tokenizer folder: eos is the tokenizer's end-of-text token
   (as ``data.tokenizer`` finds it), bos and pad are ``tokenizer_config.json``'s ``bos_token`` /
   ``pad_token`` looked up in its vocabulary, and pad is eos when it names none (as most LLaMA
   exports do). Its ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
   ``tokenizer.model`` (those that exist) are copied into OUT, so ``AutoTokenizer`` loads OUT too;
2. the run's ``data.tokenizer`` saved with the checkpoint, when it is such a folder (used and
   copied the same way);
3. the ``generation_config.json`` / ``config.json`` of the run's ``model.init_from`` (of IN for
   the params.npz form, where ``--to-jax`` copied it): the ids only, no tokenizer files;
4. none (the byte tokenizer has no end-of-text token): the ids are written as null, generation
   runs to its length limit, and a line says so.

An id outside ``model.vocab_size`` is an error (exit status 2).

A reward model's checkpoint (``training.objective=reward``: ``model.num_labels=1``) is written as its
family's ``*ForSequenceClassification`` (``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``,
...: ``score.weight``, no ``lm_head``, ``id2label``), which
``transformers.AutoModelForSequenceClassification.from_pretrained(OUT)`` loads with no missing or unexpected
keys; its ``pad_token_id`` is the id the training rows were padded with (the end-of-text id, 0 without one),
so that transformers reads the score at the token the training did.

A LoRA run's checkpoint (``model.lora.rank > 0``) exports its adapters as a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained``
on the base model), or with ``--merge-lora`` the full model with the adapters merged into the
weights, as PEFT's ``merge_and_unload`` gives it.

To fine-tune from a Hugging Face directory, no conversion is needed: set ``model.init_from``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import numpy as np
import yaml
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxcolossal.config import ConfigError, ModelConfig, config_from_dict  # noqa: E402
from jaxcolossal.data import get_tokenizer  # noqa: E402
from jaxcolossal.errors import DependencyError  # noqa: E402
from jaxcolossal.models.hf_io import GENERATION_CONFIG, config_to_hf, load_hf, read_special_tokens, save_hf  # noqa: E402
from jaxcolossal.models.layers.lora import merged_weights, split  # noqa: E402
from jaxcolossal.models.peft import save_adapters  # noqa: E402
from jaxcolossal.runtime.launch import use_cpu_without_gpu  # noqa: E402


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"layers": {"wq": a}}`` -> ``{"layers/wq": a}``."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else k
        out.update(flatten(v, name) if isinstance(v, dict) else {name: v})
    return out


def unflatten(flat: dict) -> dict:
    """The inverse of :func:`flatten`."""
    out: dict = {}
    for name, v in flat.items():
        node = out
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _tokenizer_folder(path: str) -> str:
    """The folder of a tokenizer path (a folder, or its tokenizer.json / tokenizer.model)."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _token_lookup(path: str):
    """``name -> id or None`` over the vocabulary of the tokenizer at ``path``."""
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if file.endswith(".json") and os.path.isfile(file):
        return Tokenizer.from_file(file).token_to_id
    import sentencepiece  # optional (the data extra): SentencePiece-only tokenizer folders

    sp = sentencepiece.SentencePieceProcessor(model_file=file if file.endswith(".model")
                                              else os.path.join(path, "tokenizer.model"))

    def lookup(name):
        i = sp.piece_to_id(name)
        return i if sp.id_to_piece(i) == name else None
    return lookup


def tokenizer_ids(path: str) -> dict:
    """bos/eos/pad ids of the Hugging Face tokenizer at ``path`` (a folder, or its file): eos from
    ``jaxcolossal.data.get_tokenizer``, bos and pad named by ``tokenizer_config.json`` (else
    ``special_tokens_map.json``) and looked up in the vocabulary; pad defaults to eos.

    Raises:
        FileNotFoundError: ``path`` holds no ``tokenizer.json`` or ``tokenizer.model``.
    """
    folder = _tokenizer_folder(path)
    if not os.path.exists(path) or not any(os.path.isfile(os.path.join(folder, f))
                                           for f in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"tokenizer {path!r}: no tokenizer.json or tokenizer.model there "
                                "(a Hugging Face tokenizer folder is needed)")
    eos = get_tokenizer(path).eos_id
    names: dict = {}
    for f in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        if os.path.isfile(os.path.join(folder, f)):
            with open(os.path.join(folder, f)) as fh:
                names.update({k: v for k, v in json.load(fh).items() if k in ("bos_token", "pad_token") and v})
    lookup = _token_lookup(path)

    def token_id(entry):
        name = entry.get("content") if isinstance(entry, dict) else entry
        return lookup(name) if isinstance(name, str) else None

    bos, pad = token_id(names.get("bos_token")), token_id(names.get("pad_token"))
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos if pad is None else pad}


def copy_tokenizer(path: str, out: str) -> list[str]:
    """Copy the tokenizer files of ``path`` (:data:`TOKENIZER_FILES`, those that exist) into ``out``."""
    folder = _tokenizer_folder(path)
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f))]
    for f in copied:
        shutil.copyfile(os.path.join(folder, f), os.path.join(out, f))
    return copied


def special_tokens(src: str, saved: dict | None, tokenizer: str | None) -> tuple[dict, str | None]:
    """The special-token ids for ``--to-hf`` (module doc for the order) and the tokenizer whose
    files go with the export (None: none). ``saved`` is the checkpoint's saved config (None for
    the params.npz form). Prints where the ids came from.
    """
    saved = saved or {}
    run_tok = (saved.get("data") or {}).get("tokenizer")
    if tokenizer is None and run_tok not in (None, "", "byte", "auto"):
        if os.path.exists(run_tok):
            tokenizer = run_tok
            print(f"using the run's tokenizer {run_tok} (data.tokenizer)")
        else:
            print(f"the run's tokenizer {run_tok} (data.tokenizer) does not exist any more")
    if tokenizer is not None:
        ids = tokenizer_ids(tokenizer)
        print(f"special tokens from {tokenizer}: " + ", ".join(f"{k} {v}" for k, v in ids.items()))
        if ids["eos_token_id"] is None:
            print(f"{tokenizer} names no end-of-text token: generate() on the export will not stop by itself")
        return ids, tokenizer
    hf_dir = (saved.get("model") or {}).get("init_from") if saved else src
    ids = read_special_tokens(hf_dir) if hf_dir and os.path.isdir(hf_dir) else {}
    if ids:
        print(f"special tokens from {hf_dir}: " + ", ".join(f"{k} {v}" for k, v in ids.items()))
        return ids, None
    print("no special-token ids found (a byte-tokenizer run has no end-of-text token): generate() on the export "
          "will not stop by itself; pass --tokenizer DIR (a Hugging Face tokenizer folder) to set them")
    return dict(NO_IDS), None


FINE_TUNING_MAX_SEQ_LEN = 2048
"""The longest ``training.seq_len`` :func:`fine_tuning_training` writes, in tokens."""

FINE_TUNING_COMMENT = """\
# Fine-tuning defaults, written by scripts/convert_hf.py --to-jax in place of the schema's tiny
# byte-level pre-training ones (learning_rate 3e-3, weight_decay 0.1, seq_len 128), which wreck a
# pretrained model: full SFT at 2e-5 (TRL's SFTTrainer default), no weight decay, a warmup of
# about 3% of max_steps then a cosine decay to 0, seq_len = min(max_position_embeddings, 2048).
# Scale warmup_steps with max_steps. LoRA runs (model.lora.rank > 0) usually want 1e-4 to 2e-4:
# pass training.learning_rate=1e-4.
"""


def fine_tuning_training(cfg: ModelConfig) -> dict:
    """The ``training:`` section ``--to-jax`` writes for ``cfg``'s model: full-SFT defaults
    (learning rate 2e-5, weight decay 0, warmup 9 of 300 steps, cosine to 0) and ``seq_len`` =
    min(``cfg.max_position_embeddings``, :data:`FINE_TUNING_MAX_SEQ_LEN`) tokens."""
    return {"seq_len": min(cfg.max_position_embeddings, FINE_TUNING_MAX_SEQ_LEN), "learning_rate": 2e-5,
            "weight_decay": 0.0, "max_steps": 300, "warmup_steps": 9, "min_learning_rate_ratio": 0.0}


def to_jax(hf_dir: str, out: str, tp: int = 1, vocab_pad_multiple: int = 1) -> None:
    """HF directory -> ``out/params.npz`` + ``out/model.yaml`` (the ``model:`` section and
    :func:`fine_tuning_training`'s ``training:``, under :data:`FINE_TUNING_COMMENT`) + its
    ``generation_config.json``."""
    cfg, params = load_hf(hf_dir, tp=tp, vocab_pad_multiple=vocab_pad_multiple)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "params.npz"), **flatten(params))
    with open(os.path.join(out, "model.yaml"), "w") as f:
        yaml.safe_dump({"model": dataclasses.asdict(cfg)}, f, sort_keys=False)
        f.write(FINE_TUNING_COMMENT)
        yaml.safe_dump({"training": fine_tuning_training(cfg)}, f, sort_keys=False)
    if os.path.isfile(os.path.join(hf_dir, GENERATION_CONFIG)):
        shutil.copyfile(os.path.join(hf_dir, GENERATION_CONFIG), os.path.join(out, GENERATION_CONFIG))


def load_source(src: str, step: int | None = None) -> tuple[dict, dict, dict | None]:
    """``(model section, params, saved config)`` of a run's ``checkpoint.dir`` (``step``, default
    the newest; the fp32 master weights in bf16/fp16 runs) or of a ``params.npz`` + ``model.yaml``
    folder (saved config None)."""
    if os.path.exists(os.path.join(src, "params.npz")):
        with open(os.path.join(src, "model.yaml")) as f:
            model = (yaml.safe_load(f) or {}).get("model", {})
        with np.load(os.path.join(src, "params.npz")) as z:
            params = unflatten({k: z[k] for k in z.files})
        return model, params, None
    from jaxcolossal.checkpoint import CheckpointManager, step_dirs  # heavy: orbax; checkpoint sources only

    steps = step_dirs(src)
    parent = os.path.dirname(os.path.abspath(src))
    if not steps and os.path.basename(os.path.abspath(src)).isdigit() and step_dirs(parent):
        raise FileNotFoundError(f"{src!r} is one step of a checkpoint dir: pass {parent!r} with "
                                f"--step {os.path.basename(os.path.abspath(src))}")
    if not steps:
        raise FileNotFoundError(f"{src!r} holds neither params.npz + model.yaml nor checkpoint steps")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"{src!r} has no step {step}; its steps: {', '.join(map(str, steps))}")
    ckpt = CheckpointManager(src)
    try:
        params, step = ckpt.restore_params(step)
        saved = ckpt.saved_config(step)
    finally:
        ckpt.close()
    if not saved.get("model"):
        raise ValueError(f"checkpoint step {step} in {src!r} carries no saved config (written by an older "
                         "jaxcolossal): export it with params.npz + model.yaml instead")
    print(f"exporting step {step} of {os.path.abspath(src)}")
    return saved["model"], params, saved


def score_pad_id(ids: dict) -> int:
    """A reward model's ``pad_token_id``: the id its training rows were padded with, the end-of-text id
    (the first of a list) or 0 without one (:func:`jaxcolossal.data.reward_pairs.pad_token_id`), which
    transformers' sequence-classification pooling must skip as the training's did."""
    eos = ids.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return 0 if eos is None or eos == [] else int(eos)


def to_hf(src: str, out: str, max_shard_size: str = "5GB", step: int | None = None,
          tokenizer: str | None = None, merge_lora: bool = False) -> list[str]:
    """A trained model -> HF directory ``out``; returns the weight files.

    A LoRA run (``model.lora.rank > 0``) exports its adapters as a PEFT folder
    (``adapter_config.json`` + ``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained``
    on the base model), or with ``merge_lora`` the full model with the adapters merged into the
    weights (``W + alpha/rank · A B``).

    ``src`` is either a run's ``checkpoint.dir`` (orbax; ``step`` picks one, default the newest;
    the fp32 master weights are exported in bf16/fp16 runs, and the model section comes from the
    config saved with the checkpoint), or a folder with ``params.npz`` + ``model.yaml``. The
    special-token ids come from ``tokenizer``, the run's tokenizer or its HF config
    (:func:`special_tokens`); the tokenizer's files are copied into ``out``.
    """
    model, params, saved = load_source(src, step)
    # validated as a config whose only other setting is a sequence length that any model accepts (a score
    # head's, with the objective that trains one)
    rm = {"training": {"seq_len": 1, "objective": "reward"}, "data": {"format": "preference", "corpus": "-"}}
    cfg = config_from_dict({"model": {**model, "init_from": ""},
                            **(rm if model.get("num_labels") else {"training": {"seq_len": 1}})}).model
    if cfg.lora.enabled and not merge_lora:  # a LoRA run: its adapters, in PEFT's format
        return save_adapters(out, cfg, split(params)[1], base_model=model.get("init_from", ""))
    if cfg.lora.enabled:  # W + (alpha/rank)·A·B: the full model, as PEFT's merge_and_unload
        params = merged_weights(params, cfg.lora)
    elif merge_lora:
        raise ValueError(f"--merge-lora: {src!r} holds no LoRA adapters (its model.lora.rank is 0)")
    ids, tok = special_tokens(src, saved, tokenizer)
    if cfg.num_labels:  # a reward model: its score is read at the last token that is not the rows' pad
        ids = {**ids, "pad_token_id": score_pad_id(ids)}
        print(f"a reward model (model.num_labels={cfg.num_labels}): written as "
              f"{config_to_hf(cfg)['architectures'][0]} with pad_token_id {ids['pad_token_id']}")
    files = save_hf(out, cfg, params, max_shard_size=max_shard_size, special_tokens=ids)
    if tok is not None:
        print(f"copied {', '.join(copy_tokenizer(tok, out))} from {_tokenizer_folder(tok)}")
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-jax", nargs=2, metavar=("HF_DIR", "OUT"), help="Hugging Face dir -> params.npz + model.yaml")
    mode.add_argument("--to-hf", nargs=2, metavar=("IN", "OUT"),
                      help="a run's checkpoint.dir (or a params.npz + model.yaml dir) -> Hugging Face dir")
    ap.add_argument("--step", type=int, default=None, help="--to-hf from a checkpoint dir: the step (default: newest)")
    ap.add_argument("--tp", type=int, default=1, help="--to-jax: pad the vocabulary for this tensor-parallel size")
    ap.add_argument("--vocab-pad-multiple", type=int, default=1, help="--to-jax: pad the vocabulary to a multiple of this × tp")
    ap.add_argument("--max-shard-size", default="5GB", help="--to-hf: shard above this size (default 5GB)")
    ap.add_argument("--merge-lora", action="store_true",
                    help="--to-hf of a LoRA run: write the full model with the adapters merged into its weights "
                         "(default: the adapters alone, in PEFT's format)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="--to-hf: a Hugging Face tokenizer folder: its files are copied into OUT and its "
                         "bos/eos/pad ids written (pad = eos when it names no pad token, as most LLaMA exports "
                         "do); default: the run's data.tokenizer, else the ids of its model.init_from")
    args = ap.parse_args(argv)

    use_cpu_without_gpu()  # host arrays only: no GPU start (and no log of a failed one) where a CUDA plugin is

    try:
        if args.to_jax:
            to_jax(*args.to_jax, tp=args.tp, vocab_pad_multiple=args.vocab_pad_multiple)
            print(f"wrote {args.to_jax[1]}/params.npz and {args.to_jax[1]}/model.yaml")
        else:
            files = to_hf(*args.to_hf, max_shard_size=args.max_shard_size, step=args.step, tokenizer=args.tokenizer,
                          merge_lora=args.merge_lora)
            print(f"wrote {', '.join(files) if 'adapter_config.json' in files else 'config.json, ' + ', '.join(files)} "
                  f"in {args.to_hf[1]}")
    except (ConfigError, DependencyError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
