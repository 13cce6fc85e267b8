"""scripts/readme_commands.py reads every command of README.md's "What you can run" table, and each
one names scripts and modules that exist, config keys that load, and placeholders it has fixtures
for. Nothing runs: the commands themselves run in ``python scripts/readme_commands.py``."""

import os
import re
import shlex
import sys

import pytest

from jaxcolossal.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import grpo_arithmetic  # noqa: E402
import readme_commands as rc  # noqa: E402

COMMANDS = rc.readme_commands()


def _dummy(tmp_path):
    """A resolver: every placeholder a path under ``tmp_path`` (HF_DIR with a tokenizer.json, which
    ``data.tokenizer`` is checked for), ``N`` a vocabulary size."""
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "tokenizer.json").write_text("{}")
    return lambda name: "512" if name == "N" else str(hf) if name == "HF_DIR" else str(tmp_path / rc.FIXTURES[name][0])


def test_every_backticked_command_of_the_table_is_found():
    text = open(rc.README).read().split(rc.HEADING, 1)[1].split("\n\n", 2)[1]  # the table
    lines = [line for line in text.splitlines() if line.startswith("|")][2:]
    rows = rc.table_rows()
    assert len(rows) == len(lines) > 10
    assert all(rc.row_commands(row[1]) for row in rows), "a row without a backticked command"
    assert len(COMMANDS) == sum(line.split(" | ")[1].count("`") // 2 for line in lines)
    assert all(cmd.startswith(("python ", "bash ")) for cmd in COMMANDS), COMMANDS
    assert "python scripts/convert_hf.py --to-hf checkpoints/tiny HF_OUT" in COMMANDS  # `a / --b` continues a


@pytest.mark.parametrize("cmd", COMMANDS)
def test_the_scripts_and_modules_named_exist(cmd):
    words = shlex.split(cmd)
    for w in words:
        if re.fullmatch(r"scripts/\S+\.(py|sh)", w):
            assert os.path.isfile(os.path.join(ROOT, w)), w
    for i, w in enumerate(words[:-1]):
        if w == "-m":
            path = os.path.join(ROOT, *words[i + 1].split("."))
            assert os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__main__.py")), words[i + 1]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_placeholder_has_a_fixture_and_every_path_exists(cmd, tmp_path):
    assert set(rc.placeholders(cmd)) <= set(rc.FIXTURES), rc.placeholders(cmd)
    run = shlex.split(rc.as_run(cmd, str(tmp_path / "cmd"), _dummy(tmp_path)))
    for w in run:
        value = w.split("=", 1)[1] if re.match(r"[a-z_]+\.[a-z_]+=", w) else w
        if "/" in value and not value.startswith("/"):
            assert os.path.exists(os.path.join(ROOT, value)), f"{value!r}: not in the repository, not a placeholder"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if "scripts/train.py" in c.split()])
def test_the_overrides_of_train_commands_load(cmd, tmp_path):
    """As run: README's overrides and this script's (placeholders filled), on the command's config
    (configs/llama_tiny.yaml where it is a fixture's)."""
    words = shlex.split(rc.as_run(cmd, str(tmp_path / "cmd"), _dummy(tmp_path)))
    words = words[words.index("scripts/train.py") + 1:]
    config = words[words.index("--config") + 1] if "--config" in words else "configs/llama_tiny.yaml"
    overrides = [w for w in words if re.match(r"[a-z_]+(\.[a-z_]+)+=", w)]
    if not os.path.isfile(os.path.join(ROOT, config)):
        config = "configs/llama_tiny.yaml"
    cfg = load_config(os.path.join(ROOT, config), overrides)
    if rc.is_training(cmd):
        assert cfg.training.max_steps == 3 and cfg.logging.run_dir.startswith(str(tmp_path))


def test_the_rules():
    dummy = lambda name: f"<{name}>"  # noqa: E731
    run = rc.as_run("python scripts/train.py checkpoint.dir=checkpoints/tiny offload.nvme_path=/tmp/x", "/w", dummy)
    assert "checkpoint.dir=/w/checkpoint" in run and "offload.nvme_path=/w/nvme" in run
    assert run.endswith(" ".join(rc.SMALL_RUN) + " logging.run_dir=/w/run")
    assert rc.as_run("python scripts/train.py --config X.yaml --dry-run", "/w", dummy) == \
        "python scripts/train.py --config X.yaml --dry-run"
    assert rc.as_run("python scripts/x.py --to-hf checkpoints/tiny HF_OUT OUT/model.yaml", "/w", dummy) == \
        "python scripts/x.py --to-hf <checkpoints/tiny> <HF_OUT> <OUT>/model.yaml"
    assert rc.substitute("a.jsonl data/*.jsonl model.vocab_size=N NX /a/N", dummy) == \
        "<a.jsonl> <data/*.jsonl> model.vocab_size=<N> NX /a/N"
    assert rc.as_run("python scripts/zero_report.py", "/w", dummy).split()[2:] == rc.QUICK["scripts/zero_report.py"]
    assert rc.needed("python scripts/train.py checkpoint.dir=checkpoints/tiny") == []
    # --eval-only evaluates the checkpoint fixture where the row names it, with the fixture's model (SMALL_RUN)
    run = rc.as_run("python scripts/train.py --eval-only checkpoint.dir=checkpoints/tiny", "/w", dummy)
    assert "checkpoint.dir=<checkpoints/tiny>" in run and run.endswith(" ".join(rc.SMALL_RUN) + " logging.run_dir=/w/run")
    assert rc.needed("python scripts/train.py --eval-only checkpoint.dir=checkpoints/tiny") == ["checkpoints/tiny"]
    # a sample is shortened, never turned on: configs/llama_tiny_long.yaml sets none (a 16k-token window)
    assert "training.sample_tokens=" not in rc.as_run("python scripts/train.py --config configs/llama_tiny_long.yaml",
                                                      "/w", dummy)
    assert "training.sample_tokens=8" in rc.as_run("python scripts/train.py training.sample_tokens=100", "/w", dummy)


def test_the_post_training_examples_keep_their_models(monkeypatch, tmp_path):
    """Issue 54 item 6: configs/dpo_tiny.yaml and the GRPO stage of scripts/grpo_arithmetic.py save a
    checkpoint (a rerun starts over); a README row on a config with a checkpoint folder writes its own."""
    for name in ("dpo_tiny", "grpo_arith"):
        c = load_config(os.path.join(ROOT, f"configs/{name}.yaml")).checkpoint
        assert c.dir and c.overwrite, (name, c)
    run = rc.as_run("python scripts/train.py --config configs/dpo_tiny.yaml", "/w", lambda name: name)
    assert "checkpoint.dir=/w/checkpoint" in run and run.count("checkpoint.dir=") == 1
    assert "checkpoint.dir=" not in rc.as_run("python scripts/train.py", "/w", lambda name: name)  # "": none
    calls = []
    monkeypatch.setattr(grpo_arithmetic, "_run", calls.append)
    monkeypatch.setattr(grpo_arithmetic, "reward_curve", lambda path: ([], []))
    assert grpo_arithmetic.main(["--out", str(tmp_path)]) == 0
    grpo = calls[-1]
    assert "configs/grpo_arith.yaml" in grpo and f"checkpoint.dir={tmp_path}/grpo/ckpt" in grpo, grpo
