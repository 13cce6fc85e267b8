"""A local Hugging Face tokenizer (``data.tokenizer=<folder with tokenizer.json>``): loading, the
corpus stream joined with its end-of-text id, clear errors, and the main job training on it."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.data import get_tokenizer, load_corpus
from jaxcolossal.data.tokenizer import HFTokenizer
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [f"def function_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(400)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A 300-entry byte-level BPE trained with the ``tokenizers`` library, saved as a HF folder,
    plus a JSON-lines corpus."""
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with open(d / "corpus.jsonl", "w") as f:
        for doc in DOCS:
            f.write(json.dumps({"text": doc}) + "\n")
    return d


def test_hf_tokenizer_loads_and_round_trips(tok_dir):
    tok = get_tokenizer(str(tok_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 300 and tok.eos_id == 0 and tok.dtype == np.uint16
    ids = tok.encode(DOCS[7])
    assert ids.dtype == np.uint16 and len(ids) < len(DOCS[7].encode())  # merges happened
    assert tok.decode(ids) == DOCS[7]
    assert get_tokenizer(str(tok_dir / "tokenizer.json")).vocab_size == 300  # the file itself
    with pytest.raises(ValueError, match="token ids must lie in"):
        tok.decode([300])


def test_corpus_joins_documents_with_eos(tok_dir):
    class Data:
        corpus = str(tok_dir / "corpus.jsonl")
        text_key = "text"
        tokenizer = str(tok_dir)
        max_corpus_bytes = 0

    stream = load_corpus(Data)
    tok = get_tokenizer(str(tok_dir))
    want = np.concatenate([np.concatenate([tok.encode(d), [0]]) for d in DOCS])[:-1]
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream, want)


def test_bad_tokenizer_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*no such file or folder"):
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [f"data.tokenizer={tmp_path}/missing"])
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*the folder has no tokenizer.json"):
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [f"data.tokenizer={tmp_path}"])


def test_main_job_trains_on_a_hf_tokenizer(tok_dir, tmp_path):
    base = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
            "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=8",
            "logging.progress_bar=false", "training.eval_every=0", "training.max_steps=6",
            f"data.tokenizer={tok_dir}", f"data.corpus={tok_dir}/corpus.jsonl", f"logging.run_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the 300 ids of data.tokenizer="):
        train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), base))
    out = train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), base + ["model.vocab_size=300"]))
    assert out["val_loss_end"] < out["val_loss_start"] < np.log(300) + 0.3


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_formats_give_the_same_stream(tok_dir, tmp_path, fmt):
    """JSON lines, parquet (pyarrow) and a saved ``datasets`` folder of the same documents give the
    same token stream; a missing column is an error that lists the columns."""
    if fmt == "parquet":
        import pyarrow as pa  # optional: pyarrow (the data extra)
        import pyarrow.parquet as pq  # optional: pyarrow (the data extra)
        corpus = str(tmp_path / "docs.parquet")
        pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), corpus)
    elif fmt == "datasets":
        import datasets  # optional: datasets (the data extra)
        corpus = str(tmp_path / "ds")
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(corpus)
    else:
        corpus = str(tok_dir / "corpus.jsonl")

    class Data:
        format = fmt
        text_key = "text"
        tokenizer = str(tok_dir)
        max_corpus_bytes = 0
        cache_dir = str(tmp_path / "cache")

    Data.corpus = corpus
    tok = get_tokenizer(str(tok_dir))
    want = np.concatenate([np.concatenate([tok.encode(d), [0]]) for d in DOCS])[:-1]
    np.testing.assert_array_equal(load_corpus(Data), want)
    np.testing.assert_array_equal(load_corpus(Data), want)  # from the cache
    if fmt != "jsonl":
        Data.text_key = "body"
        with pytest.raises(ValueError, match=r"has no column 'body' \(data.text_key\); its columns"):
            load_corpus(Data)


def test_auto_tokenizer_is_the_init_from_folders(tok_dir):
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [f"model.init_from={tok_dir}"])
    assert cfg.data.tokenizer == str(tok_dir)
    assert load_config(os.path.join(ROOT, "configs/llama_tiny.yaml")).data.tokenizer == "byte"


def test_sentencepiece_model(tmp_path):
    """A SentencePiece ``tokenizer.model`` (LLaMA-1/2's format): loaded, round-trips, joins
    documents with its eos id, and is accepted by the config (folder or file)."""
    import sentencepiece  # optional: sentencepiece (the data extra)

    text = tmp_path / "train.txt"
    text.write_text("\n".join(DOCS))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "tokenizer"),
                                             vocab_size=200, model_type="bpe", eos_id=2, bos_id=1, unk_id=0,
                                             minloglevel=2)
    for spec in (str(tmp_path / "tokenizer.model"), str(tmp_path)):
        tok = get_tokenizer(spec)
        assert tok.vocab_size == 200 and tok.eos_id == 2
        # SentencePiece's default normalization folds newlines and runs of spaces into one space
        assert tok.decode(tok.encode(DOCS[3])) == " ".join(DOCS[3].split())
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [f"data.tokenizer={tmp_path}"])
    assert cfg.data.tokenizer == str(tmp_path)
