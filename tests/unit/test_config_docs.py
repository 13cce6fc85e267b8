"""Every config key is documented beside its field (an attribute docstring in
jaxcolossal/config/schema.py), and what is built from those docstrings cannot drift: docs/config.md
equals the rendered reference, and ``scripts/train.py --help`` lists every key with its doc."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcolossal.config import all_keys, config_reference_markdown, field_docs, schema
from jaxcolossal.config.reference import first_sentence, plain

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"


def test_every_key_has_a_non_empty_doc_in_all_keys_order():
    keys = all_keys()
    docs = field_docs()
    assert len(keys) >= 115  # 115 when this test was written: the walk did not lose a section
    assert len(docs) == len(keys)
    assert list(docs) == keys
    empty = [k for k, d in docs.items() if not d or not d.strip()]
    assert not empty, f"keys without a doc: {empty}"
    assert all("\n" not in d and "  " not in d for d in docs.values())  # one line each, single spaces


def test_the_docs_are_the_fields_own_docstrings():
    docs = field_docs()
    assert docs["parallel.zero_stage"].startswith("The ZeRO stage, 0 to 3")
    assert docs["model.lora.rank"].startswith("The adapters' rank")
    assert "``offload_optim_frac``" in docs["offload.nvme_path"]


def test_a_field_without_a_docstring_is_refused():
    source = inspect.getsource(schema)
    field_line = "    zero_stage: Literal[0, 1, 2, 3] = 0\n"
    start = source.index(field_line) + len(field_line)  # the docstring's first line
    end = source.index('"""', source.index('"""', start) + 3) + 3  # its closing quotes
    without = source[:start] + source[end + 1:]  # and its newline
    assert "num_microbatches: int = 0" in without[start:start + 60]
    with pytest.raises(ValueError, match=r"parallel\.zero_stage \(ParallelConfig\.zero_stage\)"):
        field_docs(without)


def test_docs_config_md_equals_the_rendered_reference():
    text = config_reference_markdown()
    assert PAGE.read_text(encoding="utf-8") == text, (
        "docs/config.md is not the reference rendered from jaxcolossal/config/schema.py: "
        "run python scripts/config_reference.py")
    rows = re.findall(r"^\| `([\w.]+)` \|", text, flags=re.MULTILINE)
    assert rows == all_keys()


def test_the_reference_script_checks_and_writes(tmp_path):
    out = tmp_path / "config.md"
    script = [sys.executable, "scripts/config_reference.py", "--out", str(out)]
    check = subprocess.run(script + ["--check"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1, check.stdout + check.stderr  # missing
    write = subprocess.run(script, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert write.returncode == 0, write.stdout + write.stderr
    assert out.read_text(encoding="utf-8") == config_reference_markdown()
    check = subprocess.run(script + ["--check"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_train_help_prints_every_key_with_its_doc():
    run = subprocess.run([sys.executable, "scripts/train.py", "--help"], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    entries, key = {}, None
    for line in run.stdout.splitlines():
        m = re.match(r"  ([a-z_]+(?:\.[a-z_0-9]+)+) = ", line)
        if m:
            key = m.group(1)
            entries[key] = line.strip()
        elif key and line.startswith("      "):
            entries[key] += " " + line.strip()
        else:
            key = None
    assert list(entries) == all_keys()
    docs = field_docs()
    missing = [k for k in entries if plain(first_sentence(docs[k])) not in entries[k]]
    assert not missing, f"--help lacks the doc of: {missing}"


def test_save_every_says_evaluations_save_whatever_its_value():
    # issue 45 item 15c: train.loop saves at each evaluation and at the end for any save_every
    # (save = evaluate or done % save_every == 0), not only with 0
    doc = " ".join(field_docs()["checkpoint.save_every"].split())
    assert "Whatever its value" in doc and "at each evaluation" in doc and "at the end" in doc, doc
    assert "0: only at" not in doc, doc
