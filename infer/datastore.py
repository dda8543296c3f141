"""The REST datastore: a token corpus with a suffix array, memory-mapped from disk.

REST (He et al., 2023, "REST: Retrieval-Based Speculative Decoding") drafts by looking up the
longest suffix of the current context in a corpus and proposing the tokens that followed it
there, merged into a tree by frequency. This module owns the corpus side:

    DIR/header.json        {"format": "specdec-rest-datastore", "version": 1,
                            "tokenizer": {"name", "vocab_size", "fingerprint"},
                            "num_tokens", "num_documents", "sources": [...], "created"}
    DIR/tokens.npy         [T] int32  documents' token ids, each document followed by -1
    DIR/suffix_array.npy   [T] int64  start offsets of all suffixes of tokens.npy in
                                      lexicographic order (-1 sorts first, so a suffix never
                                      matches across a document boundary)

Both arrays are opened with ``np.load(mmap_mode="r")``: a multi-GB datastore costs no RAM
beyond the pages that lookups touch. Any missing or inconsistent part raises
``DatastoreError`` naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

FORMAT = "specdec-rest-datastore"
VERSION = 1
SEP = -1  # document separator in tokens.npy; smaller than every token id


class DatastoreError(RuntimeError):
    """A REST datastore is missing, corrupt or built for another tokenizer."""


# ---------------------------------------------------------------------------- building


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array of ``tokens`` [T] (any ints) by prefix doubling, re-sorting only the suffixes
    whose prefix so far is shared with another (O(T log T) numpy in practice).

    After the round with prefix length k, ``sa`` is sorted by each suffix's first k tokens and
    ``rank[i]`` is the position in ``sa`` where suffix i's group of equal k-prefixes starts, so
    comparing (rank[i], rank[i + k]) compares 2k-prefixes. A group of one is final: only the
    rest (a few percent of a text corpus after ~16 tokens) is sorted again, in place.
    Example: tokens [3, 1, 3, 1] -> suffixes "3131","131","31","1" -> [3, 1, 2, 0].
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    sa = np.argsort(tokens, kind="stable").astype(np.int64)
    pos = np.arange(n, dtype=np.int64)  # positions in sa still to sort (all, at first)
    starts = _group_starts(pos, tokens[sa])
    rank = np.empty(n, dtype=np.int64)
    rank[sa] = starts
    k = 1
    while True:
        pos = pos[_in_shared_group(starts)]
        if len(pos) == 0:
            return sa
        members = sa[pos]
        nxt = members + k  # a suffix that ends within k sorts before every longer one: -1
        second = np.where(nxt < n, rank[np.minimum(nxt, n - 1)], -1)
        key = rank[members] * (n + 1) + (second + 1)  # < n^2 + 2n: fits int64 for any corpus
        order = np.argsort(key, kind="stable")
        sa[pos] = members[order]
        starts = _group_starts(pos, key[order])
        rank[sa[pos]] = starts
        k *= 2


def _group_starts(pos: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For entries at sorted positions ``pos`` with sorted ``keys``: where each one's run of
    equal keys starts (runs never span two old groups: the old group start leads the key)."""
    new = np.ones(len(keys), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    return np.maximum.accumulate(np.where(new, pos, 0))


def _in_shared_group(starts: np.ndarray) -> np.ndarray:
    """Mask of the entries whose group (equal ``starts``) holds more than one entry."""
    shared = np.zeros(len(starts), dtype=bool)
    same = starts[1:] == starts[:-1]
    shared[1:] |= same
    shared[:-1] |= same
    return shared


def tokenizer_identity(tokenizer) -> dict:
    """Name, size and a fingerprint of the vocabulary, recorded in the datastore header."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    return {"name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            "vocab_size": len(vocab), "fingerprint": digest.hexdigest()[:16]}


def build_datastore(documents: Iterable[Sequence[int]], out_dir: str | os.PathLike, tokenizer,
                    sources: Sequence[str] = ()) -> Path:
    """Write a datastore for ``documents`` (lists of token ids) to ``out_dir`` atomically."""
    out = Path(out_dir)
    _check_replaceable(out)  # before the work: the folder is replaced as a whole at the end
    parts, n_docs = [], 0
    for doc in documents:
        if len(doc) == 0:
            continue
        parts.append(np.asarray(doc, dtype=np.int32))
        parts.append(np.array([SEP], dtype=np.int32))
        n_docs += 1
    if n_docs == 0:
        raise DatastoreError("no documents to build a datastore from (all inputs were empty)")
    tokens = np.concatenate(parts)  # [T]
    sa = build_suffix_array(tokens)  # [T]
    header = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_identity(tokenizer),
              "num_tokens": int(len(tokens)), "num_documents": n_docs,
              "sources": [str(s) for s in sources], "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    partial = out.with_name(out.name + f".partial{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        np.save(partial / "tokens.npy", tokens)
        np.save(partial / "suffix_array.npy", sa)
        (partial / "header.json").write_text(json.dumps(header, indent=2))
        _check_replaceable(out)
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)  # a killed build never leaves a half datastore behind
    except BaseException:  # Ctrl-C or a full disk: no stray .partial folder left beside --out
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that is a file, or a non-empty folder that is not a datastore: building
    replaces the folder as a whole, and must not delete what a user keeps there."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DatastoreError(f"--out {out} is a file, not a datastore folder")
    head = out / "header.json"
    try:
        is_store = json.loads(head.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        is_store = False
    if not is_store and any(out.iterdir()):
        raise DatastoreError(f"--out {out} holds files but no datastore; building one would "
                             "delete them: choose a new or empty folder")


# ---------------------------------------------------------------------------- corpus


def default_corpus_files() -> list[Path]:
    """The training prompt sets bundled with specdec (``specdec.train.data.BUNDLED``)."""
    from specdec.train.data import BUNDLED, bundled_prompts

    files = [bundled_prompts(name) for name in BUNDLED]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise DatastoreError(f"bundled prompt files are missing: {', '.join(missing)}")
    return files


def corpus_paths(names: Sequence[str]) -> list[Path]:
    """Files or bundled set names (gsm8k, guanaco, ...) -> paths."""
    from specdec.train.data import BUNDLED, bundled_prompts

    paths = [bundled_prompts(n) if n in BUNDLED else Path(n) for n in names]
    for p in paths:
        if not p.exists():
            raise DatastoreError(f"corpus file {p} does not exist (nor is it a bundled set: "
                                 f"{', '.join(BUNDLED)})")
    return paths


def tokenize_corpus(paths: Sequence[str | os.PathLike], tokenizer,
                    progress: bool = False, on_error: str = "skip") -> list[list[int]]:
    """Every conversation of the files (any format ``specdec.train.data`` reads) -> its token
    ids under the tokenizer's chat template (plain turns joined by blank lines without one).
    ``on_error``: a malformed record is skipped (and counted) or stops with its file:line."""
    from tqdm.auto import tqdm

    from specdec.train.data import iter_conversations

    docs = []
    convs = iter_conversations([str(p) for p in paths], on_error=on_error)
    for conv in tqdm(convs, desc="datastore: tokenise", unit="conv", disable=not progress):
        msgs = [m for m in conv.messages if m.get("content")]
        if not msgs:
            continue
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
        else:
            text = "\n\n".join(m["content"] for m in msgs)
        docs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return docs


# ---------------------------------------------------------------------------- loading


@dataclass
class Datastore:
    """A loaded (memory-mapped) datastore; ``lookup`` is the one query REST needs."""

    path: Path
    header: dict
    tokens: np.ndarray  # [T] int32, memory-mapped
    suffix_array: np.ndarray  # [T] int64, memory-mapped

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer=None) -> "Datastore":
        """Open DIR; with ``tokenizer``, also check the datastore was built with it."""
        path = Path(path)
        head_file = path / "header.json"
        if not path.is_dir() or not head_file.exists():
            raise DatastoreError(f"{path} is not a REST datastore (no header.json); build one with "
                                 "`specdec-data datastore --target NAME --out DIR`")
        try:
            header = json.loads(head_file.read_text())
            n = int(header["num_tokens"])
            if header.get("format") != FORMAT:
                raise ValueError(f"format is {header.get('format')!r}, expected {FORMAT!r}")
            if header.get("version") != VERSION:
                raise ValueError(f"version {header.get('version')!r}, this build reads {VERSION}")
        except (ValueError, KeyError, TypeError) as err:
            raise DatastoreError(f"{head_file}: corrupt header ({err})") from err
        arrays = {}
        for name, dtype in (("tokens", np.int32), ("suffix_array", np.int64)):
            file = path / f"{name}.npy"
            try:
                arr = np.load(file, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise DatastoreError(f"{file}: cannot be read as a .npy array ({err})") from err
            if arr.dtype != dtype or arr.shape != (n,):
                raise DatastoreError(f"{file}: expected {np.dtype(dtype).name} [{n}] as the header "
                                     f"says, found {arr.dtype} {list(arr.shape)}")
            arrays[name] = arr
        store = cls(path, header, arrays["tokens"], arrays["suffix_array"])
        store._check_sample()
        if tokenizer is not None:
            want, have = tokenizer_identity(tokenizer), header.get("tokenizer", {})
            if want["fingerprint"] != have.get("fingerprint"):
                raise DatastoreError(
                    f"{path} was built with tokenizer {have.get('name')!r} (vocab "
                    f"{have.get('vocab_size')}), but the target uses {want['name']!r} (vocab "
                    f"{want['vocab_size']}): rebuild it with `specdec-data datastore`")
        return store

    def _check_sample(self, probes: int = 64) -> None:
        """Cheap corruption check: sampled suffix-array neighbours must be in order."""
        n = len(self.suffix_array)
        if n < 2:
            return
        idx = np.unique(np.linspace(0, n - 2, num=min(probes, n - 1)).astype(np.int64))
        for i in idx:
            a, b = int(self.suffix_array[i]), int(self.suffix_array[i + 1])
            if not (0 <= a < n and 0 <= b < n) or self._compare(a, b) > 0:
                raise DatastoreError(f"{self.path / 'suffix_array.npy'}: corrupt (entries {i} and "
                                     f"{i + 1} are out of range or out of order)")

    def _compare(self, a: int, b: int, width: int = 32) -> int:
        x, y = self.tokens[a:a + width].tolist(), self.tokens[b:b + width].tolist()
        return (x > y) - (x < y)

    def __len__(self) -> int:
        return len(self.tokens)

    # -- queries ---------------------------------------------------------------

    def find(self, query: Sequence[int]) -> tuple[int, int]:
        """Suffix-array range [lo, hi) of the corpus positions where ``query`` occurs."""
        q, m, sa, toks = list(query), len(query), self.suffix_array, self.tokens

        def prefix(j: int) -> list[int]:
            s = int(sa[j])
            return toks[s:s + m].tolist()  # may be shorter than m at the end: sorts before q

        lo, hi = 0, len(sa)
        while lo < hi:  # first suffix >= q
            mid = (lo + hi) // 2
            if prefix(mid) < q:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(sa)
        while lo < hi:  # first suffix whose m-prefix > q
            mid = (lo + hi) // 2
            if prefix(mid) <= q:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def lookup(self, context: Sequence[int], max_suffix: int = 16, min_suffix: int = 1,
               depth: int = 8, max_retrieve: int = 256) -> tuple[int, np.ndarray]:
        """Continuations of the longest suffix of ``context`` found in the corpus.

        The longest suffix of length max_suffix..min_suffix that occurs (REST's "exact match").
        Returns (matched length, continuations [R, depth] int64, -1 padded past a document's
        end); R <= max_retrieve, taken evenly across the match range when it is larger (the
        range is sorted by continuation, so an even stride keeps the frequencies' shape).
        """
        ctx = [int(t) for t in context[-max_suffix:]]
        # Matching is monotone in m (if the last m tokens occur, so do the last m - 1): binary
        # search for the longest, ~4 suffix-array searches instead of up to 16.
        found, lo_m, hi_m = None, max(min_suffix, 1), len(ctx)
        while lo_m <= hi_m:
            m = (lo_m + hi_m) // 2
            lo, hi = self.find(ctx[-m:])
            if hi > lo:
                found, lo_m = (m, lo, hi), m + 1
            else:
                hi_m = m - 1
        if found is None:
            return 0, np.zeros((0, depth), dtype=np.int64)
        m, lo, hi = found
        count = hi - lo
        picks = (np.arange(count) if count <= max_retrieve
                 else np.linspace(0, count - 1, num=max_retrieve).astype(np.int64))
        starts = np.asarray(self.suffix_array[lo + picks], dtype=np.int64) + m  # [R]
        offs = starts[:, None] + np.arange(depth)[None, :]  # [R, depth]
        inside = offs < len(self.tokens)
        cont = np.where(inside, np.asarray(self.tokens)[np.minimum(offs, len(self.tokens) - 1)],
                        SEP).astype(np.int64)
        # Past the first separator a continuation belongs to the next document.
        cont[np.cumsum(cont == SEP, axis=1) > 0] = SEP
        return m, cont


# ---------------------------------------------------------------------------- defaults + CLI


def default_datastore(target) -> Datastore:
    """The datastore over the bundled prompts for this target's tokenizer, built once and
    cached under ``cache_dir()/datastores/<tokenizer fingerprint>``."""
    from specdec.infer.target import cache_dir

    ident = tokenizer_identity(target.tokenizer)
    folder = cache_dir() / "datastores" / f"bundled-{ident['fingerprint']}"
    if not (folder / "header.json").exists():
        files = default_corpus_files()
        build_datastore(tokenize_corpus(files, target.tokenizer), folder, target.tokenizer,
                        sources=[f.name for f in files])
    return Datastore.load(folder, target.tokenizer)


def add_datastore_arguments(parser) -> None:
    """The ``specdec-data datastore`` subcommand's flags."""
    parser.add_argument("--target", default="smollm2-135m",
                        help="target whose tokenizer tokenises the corpus (default: %(default)s)")
    parser.add_argument("--data", nargs="*", default=None, metavar="FILE",
                        help="JSON/JSONL conversation files or bundled set names (default: all "
                             "bundled prompt sets)")
    parser.add_argument("--out", required=True, help="datastore folder to write")
    parser.add_argument("--on-error", default="skip", choices=["skip", "fail"],
                        help="malformed record: skip it and print a count, or stop with file:line "
                             "(default: %(default)s)")


def datastore_command(args) -> int:
    """``specdec-data datastore``: tokenise a corpus with the target's tokenizer and write the
    suffix-array datastore that ``rest=DIR`` reads."""
    import sys

    from transformers import AutoTokenizer

    from specdec.infer.target import resolve_target

    try:
        _, where, gguf = resolve_target(args.target)
        tokenizer = AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf} if gguf else {}))
        files = corpus_paths(args.data) if args.data else default_corpus_files()
        _check_replaceable(Path(args.out))  # before the corpus is tokenised
        docs = tokenize_corpus(files, tokenizer, progress=True, on_error=args.on_error)
        out = build_datastore(docs, args.out, tokenizer, sources=[f.name for f in files])
        store = Datastore.load(out, tokenizer)
    except DatastoreError as err:
        print(f"specdec-data datastore: error: {err}", file=sys.stderr)
        return 2
    print(f"datastore {out}: {store.header['num_documents']} documents, {len(store)} tokens")
    return 0
