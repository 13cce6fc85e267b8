"""Convert between Hugging Face model directories and jaxcolossal params files (LLaMA, GPT-2).

    python scripts/convert_hf.py --to-jax HF_DIR OUT [--tp 2 --vocab-pad-multiple 64]
    python scripts/convert_hf.py --to-hf  CHECKPOINT_DIR OUT [--step N] [--max-shard-size 5GB]
    python scripts/convert_hf.py --to-hf  IN OUT   # IN holds params.npz + model.yaml

``--to-jax`` reads a LOCAL Hugging Face directory — ``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json`` of a ``LlamaForCausalLM`` or ``GPT2LMHeadModel``
(fp32, fp16 or bf16) — and writes, in the directory OUT:

* ``params.npz``: the params dict (float32 numpy, vocabulary padded for ``--tp`` /
  ``--vocab-pad-multiple``), one array per parameter, named by its path joined with ``/``
  (``embed_tokens``, ``layers/wq``, ...; see ``jaxcolossal.models.llama`` / ``gpt2``);
* ``model.yaml``: the ``model:`` section of a jaxcolossal config for those weights.

``--to-hf`` reads a training run's ``checkpoint.dir`` directly (the newest step, or ``--step``;
fp32 master weights in bf16/fp16 runs; the model config saved with the checkpoint), or that
pair (``IN/params.npz`` + ``IN/model.yaml``), and writes a Hugging Face directory:
``config.json`` plus ``model.safetensors`` (float32), or shards plus
``model.safetensors.index.json`` above ``--max-shard-size``; the vocabulary padding is removed, and
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it with no missing or unexpected
keys. Tokenizer files are not converted: copy them next to the weights yourself.

To fine-tune from a Hugging Face directory, no conversion is needed: set ``model.init_from``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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


def to_jax(hf_dir: str, out: str, tp: int = 1, vocab_pad_multiple: int = 1) -> None:
    """HF directory -> ``out/params.npz`` + ``out/model.yaml``."""
    import numpy as np
    import yaml

    from jaxcolossal.models.hf import load_hf

    cfg, params = load_hf(hf_dir, tp=tp, vocab_pad_multiple=vocab_pad_multiple)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "params.npz"), **flatten(params))
    with open(os.path.join(out, "model.yaml"), "w") as f:
        yaml.safe_dump({"model": dataclasses.asdict(cfg)}, f, sort_keys=False)


def to_hf(src: str, out: str, max_shard_size: str = "5GB", step: int | None = None) -> list[str]:
    """A trained model -> HF directory ``out``; returns the weight files.

    ``src`` is either a run's ``checkpoint.dir`` (orbax; ``step`` picks one, default the newest;
    the fp32 master weights are exported in bf16/fp16 runs, and the model section comes from the
    config saved with the checkpoint), or a folder with ``params.npz`` + ``model.yaml``.
    """
    import numpy as np
    import yaml

    from jaxcolossal.config import config_from_dict
    from jaxcolossal.models.hf import save_hf

    if os.path.exists(os.path.join(src, "params.npz")):
        with open(os.path.join(src, "model.yaml")) as f:
            model = (yaml.safe_load(f) or {}).get("model", {})
        with np.load(os.path.join(src, "params.npz")) as z:
            params = unflatten({k: z[k] for k in z.files})
    else:
        from jaxcolossal.checkpoint import CheckpointManager, step_dirs

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
            model = ckpt.saved_config(step).get("model")
        finally:
            ckpt.close()
        if not model:
            raise ValueError(f"checkpoint step {step} in {src!r} carries no saved config (written by an older "
                             "jaxcolossal): export it with params.npz + model.yaml instead")
        print(f"exporting step {step} of {os.path.abspath(src)}")
    # validated as a config whose only other setting is a sequence length that any model accepts
    cfg = config_from_dict({"model": {**model, "init_from": ""}, "training": {"seq_len": 1}}).model
    return save_hf(out, cfg, params, max_shard_size=max_shard_size)


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
    args = ap.parse_args(argv)

    from jaxcolossal.config import ConfigError

    try:
        if args.to_jax:
            to_jax(*args.to_jax, tp=args.tp, vocab_pad_multiple=args.vocab_pad_multiple)
            print(f"wrote {args.to_jax[1]}/params.npz and {args.to_jax[1]}/model.yaml")
        else:
            files = to_hf(*args.to_hf, max_shard_size=args.max_shard_size, step=args.step)
            print(f"wrote {args.to_hf[1]}/config.json and {', '.join(files)}")
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
