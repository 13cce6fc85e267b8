"""Run every command of README.md's "What you can run" table, as written, with a few steps.

    python scripts/readme_commands.py                   # every row (about 20 minutes on 2 cores)
    python scripts/readme_commands.py --only convert_hf # the rows whose command contains convert_hf
    python scripts/readme_commands.py --list            # the commands as they would run; runs nothing
    python scripts/readme_commands.py --timeout 300     # seconds per command (default 600)

The commands are read from the table's second column: every backticked command (``a / b`` are
two; one that starts with an option continues the program of the one before it, so ``--to-hf X Y``
runs as ``python scripts/convert_hf.py --to-hf X Y``). Each runs with bash from the repository root,
``python`` being the interpreter that runs this script, changed only by these rules:

* a training run (``scripts/train.py`` without ``--dry-run`` or ``--compile-for``, also under
  ``python -m jaxcolossal.run``) gets SMALL_RUN's overrides (its sample shortened, never turned on)
  and a ``logging.run_dir`` of its own appended; its ``checkpoint.dir`` (the command's, else its config
  file's; not with ``--eval-only``, which reads the fixture's), and an ``offload.nvme_path`` under
  /tmp, move into a folder of its own;
* the placeholders of FIXTURES (``HF_DIR``, ``N``, ``data/*.jsonl``, ``checkpoints/tiny``, ...)
  become fixtures made first in a temporary folder: a tiny LLaMA saved by ``transformers`` next to a
  tokenizer trained by scripts/train_tokenizer.py, JSON lines, chat JSON lines and parquet files of
  the standard library's sources, a ``--to-jax`` conversion, a short training run's checkpoints;
* the measurement scripts of QUICK get their small-size flags appended;
* NEEDS_GPU's commands are skipped where ``nvidia-smi`` is absent.

It prints one line per command: ``ok``/``FAIL``/``skip``, seconds, the command as run (for a failure
the last 15 lines of its stderr), then ``N ok, M failed, K skipped of T commands``. Exit status 1
when any failed. The temporary folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

import train_tokenizer
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
HEADING = "## What you can run"

SMALL_RUN = ["training.max_steps=3", "training.eval_every=0", "training.sample_tokens=8",
             "logging.progress_bar=false"]
"""Appended to every training run (later overrides win), with ``logging.run_dir`` of its own; the
sample is only shortened: where the command sets ``training.sample_tokens`` 0, it stays 0."""
TRAIN_CONFIG = "configs/llama_tiny.yaml"
"""scripts/train.py's config without ``--config``."""

QUICK = {  # measurement script: flags appended for a small, quick run (argparse: the last one wins)
    "scripts/gpu_overlap.py": ["--presets", "tiny", "--layouts", "preset"],
    "scripts/plan_vs_compiler.py": ["--limit", "2"],
    "scripts/plan_vs_time.py": ["--rounds", "2", "--seq", "32"],  # its batch stays: layouts accumulate 16
    "scripts/zero_report.py": ["--precision", "fp32", "--hidden", "64", "--layers", "2"],
    "scripts/bench_pipeline.py": [],  # already tiny; its claims are checked at these sizes
    "scripts/bench_long_context.py": ["--seq", "1024", "--sizes", "1", "2"],
    "scripts/bench_offload.py": ["--layers", "2", "--hidden", "64", "--seq", "32", "--batch", "8",
                                 "--steps", "1", "--rounds", "1"],
    "scripts/bench_data.py": ["--mb", "1", "--vocab", "1000"],
    "scripts/bench_generate.py": ["--batch", "2", "--new-tokens", "8", "--repeats", "1"],
    "scripts/bench_rollout.py": ["--prompts", "24", "--slots", "4", "--max-new", "24", "--hidden", "64",
                                 "--layouts", "configs/bench/llama_1b.yaml", "--fleet", "h100x8"],
    "scripts/benchmark.py": ["--model-overrides", "num_layers=2,hidden_size=64", "--seq", "32",
                             "--batch-per-dp", "2", "--warmup", "1", "--steps", "2"],
    "scripts/bench_optimizer.py": ["--scale", "0.001", "--steps", "2", "--warmup", "1"],
    "scripts/compare.py": ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "128", "--batch", "2",
                           "--seq", "16", "--repeats", "1", "--steps", "2", "--warmup", "1",
                           "--compile-repeats", "1", "--zero-hidden", "32", "--zero-layers", "1",
                           "--zero-stages", "1,3"],
    "scripts/lean_step.py": ["--audit-seq", "256"],
    "scripts/bench_local_checkpoint.py": ["--steps", "2", "--every", "1", "--rounds", "2"],
    "scripts/grpo_arithmetic.py": ["--sft-steps", "20", "--grpo-steps", "3"],
    "scripts/bench_grpo.py": ["--steps", "2"],
}

NEEDS_GPU = ("scripts/gpu_check.sh",)
"""Skipped, with a note, where ``nvidia-smi`` is absent."""

CHAT_LINES = 128
TOKENIZER_VOCAB = 512
TEXT_BYTES = 1_000_000


# ------------------------------------------------------------------ the table
def table_rows(readme: str = README) -> list[list[str]]:
    """The cells of every row of the "What you can run" table (header and rule left out)."""
    with open(readme) as f:
        lines = f.read().splitlines()
    start = lines.index(HEADING)
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() and not rows:
            continue
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line)[1:-1]])
    return [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]


def row_commands(cell: str) -> list[str]:
    """The backticked commands of one cell; one that starts with an option continues the program
    (the words before its first option) of the command before it."""
    out = []
    for snippet in re.findall(r"`([^`]+)`", cell):
        snippet = snippet.strip()
        if snippet.startswith("-") and out:
            words = out[-1].split()
            first_option = next((i for i, w in enumerate(words) if w.startswith("-") and i > 1), len(words))
            snippet = " ".join(words[:first_option] + [snippet])
        out.append(snippet)
    return out


def readme_commands(readme: str = README) -> list[str]:
    """Every command of the table's second column, in order."""
    return [cmd for row in table_rows(readme) for cmd in row_commands(row[1])]


# ------------------------------------------------------------------ the rules
def is_training(cmd: str) -> bool:
    """``scripts/train.py`` that trains (not ``--dry-run``, not ``--compile-for``)."""
    words = cmd.split()
    return "scripts/train.py" in words and "--dry-run" not in words and "--compile-for" not in words


def placeholder_pattern() -> re.Pattern:
    """FIXTURES' names as whole words (not inside a longer name or path)."""
    names = sorted(FIXTURES, key=len, reverse=True)
    return re.compile(r"(?<![\w./*-])(" + "|".join(re.escape(n) for n in names) + r")(?![\w])")


def substitute(cmd: str, resolve) -> str:
    """``cmd`` with every placeholder replaced by ``resolve(name)``."""
    return placeholder_pattern().sub(lambda m: resolve(m.group(1)), cmd)


def config_setting(cmd: str, key: str) -> str | None:
    """``key`` (``section.name``) as a train.py command sets it: its last override, else its config
    file's, as text (None: neither sets it, or the config is a placeholder's)."""
    words = shlex.split(cmd)
    overrides = [w.split("=", 1)[1] for w in words if w.startswith(key + "=")]
    if overrides:
        return overrides[-1]
    section, name = key.split(".", 1)
    try:
        with open(os.path.join(ROOT, words[words.index("--config") + 1] if "--config" in words else TRAIN_CONFIG)) as f:
            value = yaml.safe_load(f)[section][name]
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    return None if value is None else str(value)


def sample_tokens_set(cmd: str) -> int | None:
    """``training.sample_tokens`` as a train.py command sets it: its last override, else its config
    file's (None: neither sets it, or the config is a placeholder's)."""
    try:
        return int(config_setting(cmd, "training.sample_tokens"))
    except (TypeError, ValueError):
        return None


def as_run(cmd: str, workdir: str, resolve) -> str:
    """The command with this script's rules applied; ``workdir``: this command's own folder."""
    if is_training(cmd):
        if "--eval-only" not in cmd.split():  # --eval-only reads the checkpoint the row names (the fixture)
            cmd = re.sub(r"(checkpoint\.dir=)\S+", lambda m: m.group(1) + os.path.join(workdir, "checkpoint"), cmd)
            if "checkpoint.dir=" not in cmd and config_setting(cmd, "checkpoint.dir"):  # the config file's folder
                cmd += f" checkpoint.dir={os.path.join(workdir, 'checkpoint')}"
        cmd = re.sub(r"(offload\.nvme_path=)/tmp/\S*", lambda m: m.group(1) + os.path.join(workdir, "nvme"), cmd)
        small = [o for o in SMALL_RUN if not (o.startswith("training.sample_tokens=") and sample_tokens_set(cmd) == 0)]
        cmd = " ".join([cmd] + small + [f"logging.run_dir={os.path.join(workdir, 'run')}"])
    words = cmd.split()
    for script, extra in QUICK.items():
        if script in words and extra:
            cmd = " ".join([cmd] + [shlex.quote(a) for a in extra])
    return substitute(cmd, resolve)


def needed(cmd: str) -> list[str]:
    """The placeholders ``cmd`` uses, after the rules (a moved ``checkpoint.dir`` needs none)."""
    found = []
    as_run(cmd, "/workdir", lambda name: found.append(name) or name)
    return found


def placeholders(cmd: str) -> list[str]:
    """Upper-case words of ``cmd`` (``HF_DIR``, ``N``): what must be a FIXTURES name."""
    return re.findall(r"(?<![\w./-])([A-Z][A-Z0-9_]*)(?![\w])", cmd)


# ------------------------------------------------------------------ fixtures
def _documents(limit: int = TEXT_BYTES) -> list[str]:
    """The standard library's first modules, up to ``limit`` characters."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs, size = [], 0
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and size < limit:
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
            size += len(docs[-1])
    return docs


def make_jsonl(fx: "Fixtures", path: str) -> None:
    """``path`` is ``<folder>/*.jsonl``: two files of ``{"text": ...}`` lines."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    docs = _documents()
    for i in range(2):
        with open(os.path.join(folder, f"docs-{i}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs[i::2])


def make_parquet(fx: "Fixtures", path: str) -> None:
    """``path`` is ``<folder>/*.parquet``: one file with a ``text`` column."""
    import pyarrow as pa  # heavy
    import pyarrow.parquet as pq  # heavy

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"text": _documents()}), os.path.join(os.path.dirname(path), "docs-0.parquet"))


def make_chat(fx: "Fixtures", path: str) -> None:
    """Chat JSON lines: ``messages`` and ``prompt``/``response`` rows, alternately."""
    with open(path, "w") as f:
        for i in range(CHAT_LINES):
            rec = ({"prompt": f"add {i} and {i}", "response": f"{2 * i}"} if i % 2 else
                   {"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": f"double {i}"},
                                 {"role": "assistant", "content": f"{2 * i}"}]})
            f.write(json.dumps(rec) + "\n")


def make_hf_llama(fx: "Fixtures", path: str) -> None:
    """A tokenizer (with the chat template) trained on the text and chat fixtures, and a tiny
    LLaMA of its vocabulary saved next to it by ``transformers``, with a context of 256 tokens: the
    ``training.seq_len`` that ``--to-jax`` writes for it (min(max_position_embeddings, 2048)), so
    the SFT and LoRA rows stay quick on the CPU."""
    import torch  # heavy
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy

    corpus = f"{fx.value('data/*.jsonl')},{fx.value('a.jsonl')}"
    fx.vocab = train_tokenizer.train(corpus, TOKENIZER_VOCAB, path, chat_template=True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=fx.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(path)


def vocab_size(fx: "Fixtures", path: str) -> str:
    """The fixture tokenizer's vocabulary size."""
    fx.value("HF_DIR")
    return str(fx.vocab)


def make_jax_out(fx: "Fixtures", path: str) -> None:
    """``convert_hf.py --to-jax HF_DIR path``."""
    fx.check_call(f"python scripts/convert_hf.py --to-jax {fx.value('HF_DIR')} {path}")


def make_checkpoint(fx: "Fixtures", path: str) -> None:
    """A short training run of the main job's config with ``checkpoint.dir=path``."""
    run_dir = os.path.join(fx.root, "checkpoint_run")
    fx.check_call(" ".join(["python scripts/train.py"] + SMALL_RUN + [f"logging.run_dir={run_dir}",
                                                                       f"checkpoint.dir={path}"]))


FIXTURES = {  # placeholder in README: (its path under the temporary folder, what makes it first)
    "HF_DIR": ("hf_llama", make_hf_llama),
    "HF_OUT": ("hf_out", None),
    "OUT": ("jax_out", make_jax_out),
    "N": ("", vocab_size),
    "data/*.jsonl": ("data/*.jsonl", make_jsonl),
    "data/*.parquet": ("data/*.parquet", make_parquet),
    "a.jsonl": ("chat.jsonl", make_chat),
    "my_tok": ("my_tok", None),
    "checkpoints/tiny": ("checkpoints/tiny", make_checkpoint),
}
"""``OUT/model.yaml`` is ``OUT``'s; a value (no path) comes from the maker's return."""


class Fixtures:
    """FIXTURES made on first use under ``root``; ``value(name)`` is what replaces the name."""

    def __init__(self, root: str, env: dict, timeout: float):
        self.root, self.env, self.timeout = root, env, timeout
        self.values: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.vocab = 0

    def value(self, name: str) -> str:
        if name in self.errors:
            raise RuntimeError(self.errors[name])
        if name not in self.values:
            rel, make = FIXTURES[name]
            path = os.path.join(self.root, rel) if rel else ""
            try:
                got = make(self, path) if make else None
            except Exception as e:  # reported on every command that needs it
                self.errors[name] = f"fixture {name}: {type(e).__name__}: {e}"
                raise RuntimeError(self.errors[name]) from None
            self.values[name] = got if got is not None else path
        return self.values[name]

    def check_call(self, cmd: str) -> None:
        status, _, out, err = run_command(cmd, self.timeout, self.env)
        if status != 0:
            raise RuntimeError(f"{cmd!r} exited {status}:\n" + "\n".join((err or out).splitlines()[-15:]))


# ------------------------------------------------------------------ running
def child_env() -> dict:
    """This environment, with ``python`` being this interpreter."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_command(cmd: str, timeout: float, env: dict) -> tuple[int | None, float, str, str]:
    """``(exit status or None on timeout, seconds, stdout, stderr)`` of ``bash -c cmd`` in ROOT; on a
    timeout its whole process group is stopped."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        status = p.returncode
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
                out, err = p.communicate(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                out, err = "", ""
        status = None
        err = (err or "") + f"\ntimed out after {timeout:g} s"
    return status, time.perf_counter() - t0, out or "", err or ""


def run_all(commands: list[str], timeout: float, root: str) -> tuple[int, int, int]:
    """Make the fixtures the commands need, run each command, print a line each; ``(ok, failed, skipped)``."""
    env = child_env()
    fx = Fixtures(root, env, timeout)
    for name in dict.fromkeys(n for cmd in commands for n in needed(cmd)):
        t0 = time.perf_counter()
        try:
            where = fx.value(name)
            print(f"fixture {name:<17} {time.perf_counter() - t0:7.1f}s  {where}", flush=True)
        except RuntimeError as e:
            print(f"fixture {name:<17} FAILED  {e}", flush=True)
    counts = {"ok": 0, "FAIL": 0, "skip": 0}
    for i, cmd in enumerate(commands):
        workdir = os.path.join(root, f"cmd{i:02d}")
        os.makedirs(workdir, exist_ok=True)
        try:
            run = as_run(cmd, workdir, fx.value)
        except RuntimeError as e:
            counts["FAIL"] += 1
            print(f"FAIL  {0:7.1f}s  {cmd}\n      {e}", flush=True)
            continue
        if any(g in cmd.split() for g in NEEDS_GPU) and not shutil.which("nvidia-smi"):
            counts["skip"] += 1
            print(f"skip  {0:7.1f}s  {run}   (needs a GPU: nvidia-smi is absent)", flush=True)
            continue
        status, seconds, out, err = run_command(run, timeout, env)
        word = "ok" if status == 0 else "FAIL"
        counts[word] += 1
        print(f"{word:<4}  {seconds:7.1f}s  {run}", flush=True)
        if word == "FAIL":
            tail = (err.strip() or out.strip()).splitlines()[-15:]
            print(f"      exit status {status}; last lines of its {'stderr' if err.strip() else 'stdout'}:")
            print("\n".join("      | " + line for line in tail), flush=True)
    return counts["ok"], counts["FAIL"], counts["skip"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, metavar="SUBSTRING", help="only the commands that contain it")
    ap.add_argument("--list", action="store_true", help="print the commands as they would run, run nothing")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command (default 600)")
    args = ap.parse_args(argv)
    commands = [c for c in readme_commands() if args.only is None or args.only in c]
    if not commands:
        print(f"no command of {README}'s table contains {args.only!r}", file=sys.stderr)
        return 2
    if args.list:
        listed = lambda name: f"<tmp>/{FIXTURES[name][0]}" if FIXTURES[name][0] else f"<{name}>"  # noqa: E731
        for i, cmd in enumerate(commands):
            print(as_run(cmd, f"<tmp>/cmd{i:02d}", listed))
        return 0
    root = tempfile.mkdtemp(prefix="readme_commands_")
    try:
        ok, failed, skipped = run_all(commands, args.timeout, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{ok} ok, {failed} failed, {skipped} skipped of {len(commands)} commands")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
