"""The loop's first phase: every check that needs the file system, before anything compiles
(:func:`preflight`): the output folders (:func:`check_output_dir`), ``model.init_from``, ``posttrain.ref_model``,
the tokenizer against ``model.vocab_size``, and ``training.resume`` against the checkpoint folder."""

from __future__ import annotations

import os
import tempfile

import jax

from jaxcolossal import metrics as mx
from jaxcolossal.checkpoint import step_dirs
from jaxcolossal.config import Config, ConfigError
from jaxcolossal.config.derived import uses_reference
from jaxcolossal.data import get_tokenizer
from jaxcolossal.models.hf_io import check_init_from
from jaxcolossal.models.peft import read_adapter_config
from jaxcolossal.posttrain.ref_model import check_ref_model
from jaxcolossal.train.emergency import any_local_steps, default_local_dir, local_dir


OUTPUT_DIR_EXAMPLES = {"checkpoint.dir": "checkpoints/run1", "logging.run_dir": "runs/default",
                       "checkpoint.local_dir": "checkpoints/local"}
"""A value that works for each output folder key, for its refusal (relative: under the working directory)."""


def check_output_dir(key: str, path: str, example: str | None = None) -> None:
    """Refuse a folder the run would write (``key``, e.g. ``checkpoint.dir``) when it cannot be
    created: a file in its way, or a nearest existing folder where nothing can be created
    (permissions, a read-only or virtual file system such as ``/proc``). Checked by creating and
    at once removing an empty probe folder in the nearest existing one: nothing is left behind.
    ``example``: the value the refusal suggests (default: :data:`OUTPUT_DIR_EXAMPLES`'s for ``key``).

    Raises:
        ConfigError: ``checkpoint.dir='a.jsonl/ck': cannot create it: a.jsonl is a file; ...``.
    """
    head = os.path.abspath(path)
    while not os.path.exists(head) and os.path.dirname(head) != head:  # the nearest part that exists
        head = os.path.dirname(head)
    shown = head if os.path.isabs(path) else os.path.relpath(head)
    fix = f"set {key} to a folder that can be created, e.g. {key}={example or OUTPUT_DIR_EXAMPLES.get(key, 'out')}"
    if not os.path.isdir(head):
        raise ConfigError(f"{key}={path!r}: cannot create it: {shown} is a file; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxcolossal-probe-", dir=head))
    except OSError as e:
        raise ConfigError(f"{key}={path!r}: cannot create it: nothing can be created in {shown} "
                          f"({e.strerror}); {fix}") from None


def preflight(cfg: Config, eval_only: bool = False) -> None:
    """Every check that needs the file system, before anything is compiled. ``eval_only``
    (:func:`jaxcolossal.train.evaluate.evaluate_only`): the ``training.resume`` checks are left out (it never trains or saves).

    Raises:
        ConfigError: one line naming the key: ``checkpoint.dir``, ``checkpoint.local_dir`` (with
            ``checkpoint.local_every``; every process writes there) or (on process 0, which writes
            it) ``logging.run_dir`` that cannot be created (:func:`check_output_dir`);
            ``model.init_from`` missing or not matching; ``posttrain.ref_model`` neither a Hugging Face
            folder nor a checkpoint folder, or not the policy's architecture and vocabulary;
            ``model.vocab_size`` below the tokenizer's ids; ``training.resume=true`` with a
            ``checkpoint.dir`` that holds no step; a fresh run into a ``checkpoint.dir`` that
            holds steps, without ``checkpoint.overwrite``.
        DependencyError: ``logging.wandb=true`` without the ``wandb`` package (every process
            refuses, not only process 0, which logs).
    """
    m, t, c = cfg.model, cfg.training, cfg.checkpoint
    if cfg.logging.wandb:
        mx.import_wandb()
    if c.dir:
        check_output_dir("checkpoint.dir", c.dir)
    if c.dir and c.local_every and not eval_only:  # every process writes its own folder and a peer's replica
        check_output_dir("checkpoint.local_dir", local_dir(cfg),
                          example=default_local_dir(c.dir) if c.local_dir else None)
    if jax.process_index() == 0:  # the only process that writes the run folder (start_run)
        check_output_dir("logging.run_dir", cfg.logging.run_dir)
    if m.init_from:
        check_init_from(m)
    if cfg.posttrain.ref_model and uses_reference(cfg):
        check_ref_model(cfg)
    if m.lora.init_from:  # a PEFT adapter to continue: its rank, alpha and targets are the run's
        m.lora = read_adapter_config(m.lora.init_from)
    tok = get_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > m.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the {tok.vocab_size} ids of data.tokenizer="
            f"{cfg.data.tokenizer}: ids >= {m.vocab_size} would have no embedding row; set model.vocab_size "
            f">= {tok.vocab_size}")
    if not c.dir or eval_only:
        return
    steps = step_dirs(c.dir)
    if t.resume is True and not steps and not (c.local_every and any_local_steps(local_dir(cfg))):
        unfinished = sorted(n for n in os.listdir(c.dir) if "tmp" in n) if os.path.isdir(c.dir) else []
        raise ConfigError(
            f"training.resume=true, but checkpoint.dir={c.dir!r} holds no checkpoint"
            + (f" (only unfinished saves: {', '.join(unfinished)})" if unfinished else " (a typo?)")
            + "; training.resume=auto starts fresh when there is none")
    if t.resume is False and steps and not c.overwrite:
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        raise ConfigError(
            f"checkpoint.dir={c.dir!r} already holds the checkpoints of steps {shown}; a fresh run would mix "
            "with them and its retention would delete them. Continue them with training.resume=true, pick "
            "another checkpoint.dir, or set checkpoint.overwrite=true to delete them")
