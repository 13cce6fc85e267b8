"""``scripts/generate.py``: greedy tokens from a Hugging Face folder equal transformers' ``generate``
(also from text, through a LLaMA-3-style tokenizer's BOS and an eos list, as a subprocess); a finished
run's checkpoint samples from a jsonl prompts file on the run's mesh; bad input is one line on stderr
and exit status 2."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxcolossal.config import load_config
from jaxcolossal.data import get_tokenizer
from jaxcolossal.train.loop import train

ROOT = pathlib.Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.eval_batches=1", "training.sample_tokens=0", "training.eval_every=0",
         "data.max_corpus_bytes=200000", "logging.progress_bar=false", "logging.log_every=1"]


def _jsonl(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_hf_folder_greedy_equals_transformers(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
                                   bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.eval().save_pretrained(str(tmp_path / "hf"))
    prompts = ["def f", "hi"]
    assert script.main(["--hf", str(tmp_path / "hf"), "--prompt", prompts[0], "--prompt", prompts[1], "--greedy",
                        "--max-new-tokens", "6", "--ignore-eos", "--jsonl", "--devices", "8"]) == 0
    got = [r["tokens"] for r in _jsonl(capsys.readouterr().out)]
    for prompt, row in zip(prompts, got):  # one prompt at a time on the HF side: no padding involved
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            want = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
        assert row == want[0, ids.shape[1]:].tolist()


def test_llama3_folder_from_text_with_an_eos_list_equals_transformers(tmp_path):
    """``generate.py --hf DIR --greedy --jsonl`` as a user runs it, on a tiny LLaMA with a LLaMA-3-style
    tokenizer and a ``generation_config.json`` eos list: each row's tokens equal transformers'
    ``model.generate(**tok(prompts, padding=True, padding_side="left"), do_sample=False)`` up to the first
    id of the list (it crashed on the list before), the prompts tokenized with their BOS; the
    completion's text leaves every eos id out."""
    pytest.importorskip("torch")
    import hf_tiny  # optional: torch and transformers (tests/integration's tiny transformers models)

    path = str(tmp_path / "llama3")
    eos = hf_tiny.llama3_folder(path, 12)
    _, want = hf_tiny.hf_greedy_rows(path, hf_tiny.LLAMA3_PROMPTS, 12)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    prompts = [a for p in hf_tiny.LLAMA3_PROMPTS for a in ("--prompt", p)]
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--hf", path, *prompts, "--greedy",
                        "--max-new-tokens", "12", "--jsonl"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _jsonl(p.stdout)
    assert [r["prompt"] for r in rows] == hf_tiny.LLAMA3_PROMPTS
    assert [r["tokens"] for r in rows] == want
    assert any(len(r) < 11 for r in want) and any(len(r) == 12 and not set(r) & set(eos) for r in want)
    tok = get_tokenizer(path)
    for r in rows:
        assert r["completion"] == tok.decode([t for t in r["tokens"] if t not in eos])
        assert r["completion"] != tok.decode(r["tokens"]) or not set(r["tokens"]) & set(eos)


def test_checkpoint_samples_from_a_prompts_file(tmp_path, capsys):
    keys = SMALL + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path / 'run'}"]
    train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), keys + ["training.max_steps=2"]))
    (tmp_path / "p.jsonl").write_text('{"prompt": "def "}\n\n{"prompt": "import o"}\n')
    args = ["--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "5", "--temperature", "0.7",
            "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--jsonl", "--devices", "8", *keys]
    assert script.main(args) == 0
    captured = capsys.readouterr()
    rows = _jsonl(captured.out)
    assert [r["prompt"] for r in rows] == ["def ", "import o"]
    assert all(1 <= len(r["tokens"]) <= 5 for r in rows)
    assert "sampling from checkpoint step 2" in captured.err
    assert script.main(args) == 0 and _jsonl(capsys.readouterr().out) == rows  # the seed decides the draw


@pytest.mark.parametrize("args, message", [
    ([], "no prompt"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompts-file", "/nonexistent.jsonl"], "does not exist"),
    (["--prompts-file", "BAD"], "BAD:2: needs a string field"),
    (["--hf", "/nonexistent", "--prompt", "a"], "no config.json"),
    (["--prompt", "ab", "--max-new-tokens", "10000"], "--max-new-tokens 10000 after a prompt of 2 tokens runs to 10002 "
     "positions, past the model's max_position_embeddings=512: use --max-new-tokens 510 or fewer"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert script.main([*args, "--devices", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
