"""Offline corpora, splits, tokenizers, token caches and LM batches (occult.data)."""
import hashlib
import math
import os
import subprocess
import sys

import pytest
import torch

from occult.data import (CORPORA, EOT, SPLITS, batch_iterator, documents, eval_batches,
                         get_tokenizer, load_corpus, load_split, split_assignment,
                         split_documents, token_ids, unigram_loss)
from occult.data import corpora
from occult.data.batches import num_eval_windows

SAMPLE = ("HAMLET:\nTo be, or not to be, that is the question:\n\n"
          "  def f(x):\n\treturn {'a': x ** 2}  # naïve — ünïcödé, emoji \U0001F600\n" + EOT + "tail")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """One small BPE trained once for the module, in its own cache folder."""
    folder = tmp_path_factory.mktemp("tokenizers")
    get_tokenizer(vocab_size=512, cache_dir=folder)
    return folder


@pytest.mark.parametrize("name", CORPORA)
def test_corpus_is_nonempty_and_deterministic(name, tmp_path, monkeypatch):
    """The same text from the package files (an empty cache folder: shakespeare cleans its
    plays afresh) and from the cleaned documents that left in the cache."""
    text = load_corpus(name)
    assert len(text) > 500_000
    monkeypatch.setenv("OCCULT_CACHE", str(tmp_path))
    for _ in range(2):
        corpora._documents.cache_clear()                # rebuild from the package files, then the cache
        assert load_corpus(name) == text
    corpora._documents.cache_clear()
    assert [p.name.split("-")[0] for p in tmp_path.glob("corpora/*.json")] == (["shakespeare"] if name == "shakespeare"
                                                                                else [])


def test_corpora_identical_in_a_fresh_process(tmp_path):
    """Nothing in the text depends on what this process happened to import before."""
    code = ("import hashlib, importlib.util, sys; "     # corpora.py alone: no torch import
            "spec = importlib.util.spec_from_file_location('corpora', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(*(hashlib.sha256(m.load_corpus(n).encode()).hexdigest() for n in m.CORPORA))")
    env = {**os.environ, "OCCULT_CACHE": str(tmp_path)}          # an empty cache: the text cleaned afresh
    out = subprocess.run([sys.executable, "-c", code, corpora.__file__],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    assert out == [hashlib.sha256(load_corpus(name).encode()).hexdigest() for name in CORPORA]


def test_shakespeare_is_plain_dialogue():
    docs = documents("shakespeare")
    assert len(docs) == 38 and "hamlet" in docs
    hamlet = docs["hamlet"]
    assert hamlet.startswith("BERNARDO:\nWho's there?\n\nFRANCISCO:\n")
    for marker in ("**", "_", "\\", "#", "[", "&amp;", "Enter Ghost"):
        assert marker not in hamlet, marker


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match=r"corpus='nonesuch': allowed values are \['shakespeare', 'pydoc'\]"):
        load_corpus("nonesuch")
    with pytest.raises(ValueError, match=r"split='val': allowed values are \['train', 'validation', 'test'\]"):
        load_split("pydoc", "val")
    with pytest.raises(ValueError, match=r"kind='words': allowed values are \['bpe', 'byte'\]"):
        get_tokenizer(kind="words")
    with pytest.raises(ValueError, match=r"vocab_size=100: allowed values are integers >= 257"):
        get_tokenizer(vocab_size=100)


@pytest.mark.parametrize("name", CORPORA)
def test_splits_partition_documents_by_name_hash(name):
    assignment = split_assignment(name)
    parts = {split: split_documents(name, split) for split in SPLITS}
    assert all(parts.values())
    names = [set(docs) for docs in parts.values()]
    assert sum(map(len, names)) == len(documents(name)) == len(set.union(*names))
    assert len(parts["train"]) >= 0.85 * len(assignment)
    assert all(corpora.split_of_document(name, doc) == split for doc, split in assignment.items())
    assert load_split(name, "test") == "\n".join(parts["test"].values())


def test_known_split_assignment():
    """Pinned: a change here silently moves documents between train and held-out data."""
    held_out = {doc: split for doc, split in split_assignment("shakespeare").items() if split != "train"}
    assert held_out == {"henry-iv-part-2": "validation", "the-merchant-of-venice": "validation",
                        "two-gentlemen-of-verona": "test"}
    assert corpora.split_of_document("pydoc", "topic/dict") == "test"


def test_byte_tokenizer_round_trip(tmp_path):
    tok = get_tokenizer(kind="byte", cache_dir=tmp_path)
    assert tok.vocab_size == 257 and tok.eot_id == 256
    ids = tok.encode(SAMPLE)
    assert max(ids) < 256 and tok.decode(ids) == SAMPLE
    assert tok.decode(ids + [tok.eot_id]) == SAMPLE + EOT


def test_bpe_round_trip_and_cache_reuse(bpe_dir):
    files = list(bpe_dir.glob("*.json"))
    assert len(files) == 1 and "shakespeare-bpe512-" in files[0].name
    mtime = files[0].stat().st_mtime_ns
    tok = get_tokenizer(vocab_size=512, cache_dir=bpe_dir)
    assert tok.loaded_from_cache and tok.vocab_size == 512
    assert files[0].stat().st_mtime_ns == mtime
    for text in (SAMPLE, load_split("pydoc", "validation")[:5000]):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode(EOT) == [tok.eot_id]
    assert len(tok.encode("To be, or not to be")) < len("To be, or not to be") / 2


def test_bpe_training_is_deterministic(bpe_dir, tmp_path):
    get_tokenizer(vocab_size=512, cache_dir=tmp_path)
    (first,), (second,) = bpe_dir.glob("*.json"), tmp_path.glob("*.json")
    assert first.name == second.name and first.read_bytes() == second.read_bytes()


def test_cache_folder_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OCCULT_CACHE", str(tmp_path))
    assert get_tokenizer(kind="byte").cache_dir == tmp_path / "tokenizers"


def test_token_ids_cached_and_equal_to_encoding(bpe_dir):
    tok = get_tokenizer(vocab_size=512, cache_dir=bpe_dir)
    ids_N = token_ids("shakespeare", "validation", tok)
    assert ids_N.dtype == torch.long and ids_N.dim() == 1
    cached = list(bpe_dir.glob(f"{tok.name}.shakespeare-validation-*.npy"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    assert torch.equal(token_ids("shakespeare", "validation", tok), ids_N)
    assert cached[0].stat().st_mtime_ns == mtime
    docs = list(split_documents("shakespeare", "validation").values())
    expected = []
    for text in docs:
        expected += tok.encode(text) + [tok.eot_id]
    assert ids_N.tolist() == expected
    assert int((ids_N == tok.eot_id).sum()) == len(docs)


def test_batch_iterator_shapes_shift_and_determinism():
    ids_N = torch.arange(1000) % 97
    a = list(batch_iterator(ids_N, batch_size=4, seq_len=16, seed=3, num_batches=5))
    b = list(batch_iterator(ids_N, batch_size=4, seq_len=16, seed=3, num_batches=5))
    c = list(batch_iterator(ids_N, batch_size=4, seq_len=16, seed=4, num_batches=5))
    assert len(a) == 5
    for (x_BS, y_BS), (x2_BS, y2_BS) in zip(a, b):
        assert x_BS.shape == y_BS.shape == (4, 16) and x_BS.dtype == y_BS.dtype == torch.long
        assert torch.equal(x_BS, x2_BS) and torch.equal(y_BS, y2_BS)
        assert torch.equal(x_BS[:, 1:], y_BS[:, :-1])
        assert torch.equal(y_BS[:, -1], (x_BS[:, -1] + 1) % 97)
    assert any(not torch.equal(x[0], z[0]) for x, z in zip(a, c))


def test_batch_iterator_reaches_both_ends():
    ids_N = torch.arange(10)
    seen = torch.zeros(10, dtype=torch.bool)
    for x_BS, y_BS in batch_iterator(ids_N, batch_size=8, seq_len=3, seed=0, num_batches=50):
        seen[x_BS.flatten()] = True
        seen[y_BS.flatten()] = True
    assert bool(seen.all())
    with pytest.raises(ValueError, match=r"seq_len=10: allowed values are 1\.\.9"):
        next(batch_iterator(ids_N, batch_size=1, seq_len=10, seed=0))


@pytest.mark.parametrize("num_tokens, batch_size, seq_len", [(101, 3, 10), (100, 4, 10), (57, 2, 7)])
def test_eval_batches_cover_without_overlap(num_tokens, batch_size, seq_len):
    ids_N = torch.arange(num_tokens)
    batches = list(eval_batches(ids_N, batch_size, seq_len))
    assert all(x.shape[0] <= batch_size and x.shape[1] == seq_len for x, _ in batches)
    x_W = torch.cat([x.flatten() for x, _ in batches])
    y_W = torch.cat([y.flatten() for _, y in batches])
    windows = num_eval_windows(num_tokens, seq_len)
    assert windows * seq_len > num_tokens - 1 - seq_len
    assert torch.equal(x_W, ids_N[:windows * seq_len])
    assert torch.equal(y_W, ids_N[1:windows * seq_len + 1])


def test_unigram_loss_baseline(tmp_path):
    tok = get_tokenizer(kind="byte", cache_dir=tmp_path)
    train_ids = token_ids("pydoc", "validation", tok)
    eval_ids = token_ids("pydoc", "test", tok)
    loss = unigram_loss(train_ids, eval_ids, tok.vocab_size)
    assert math.isfinite(loss) and 0.0 < loss < math.log(tok.vocab_size)
    uniform = unigram_loss(torch.empty(0, dtype=torch.long), eval_ids, tok.vocab_size)
    assert uniform == pytest.approx(math.log(tok.vocab_size))
    with pytest.raises(ValueError, match="eval_ids"):
        unigram_loss(train_ids, torch.tensor([tok.vocab_size]), tok.vocab_size)
