"""
Prepare English LaTeX sources as GPT-2 BPE tokens: the offline stand-in for the Pile's ArXiv subset
(which is raw LaTeX of papers).

    python data/texdoc/prepare.py              # apt-get download the TeX Live doc packages into raw/
    python data/texdoc/prepare.py --src DIR    # or any folder tree of .tex / .tex.gz files

Source: Debian's TeX Live documentation packages (default texlive-science-doc and
texlive-publishers-doc: package manuals, journal templates and sample articles; LPPL/GPL/MIT/public
domain), fetched with `apt-get download` and unpacked with `dpkg -x`, nothing installed. Every .tex
and .tex.gz file is a document. Kept: the English ones (is_english below) and the first of each set
of exact duplicates (same text after newline normalisation; files sorted by path). Validation holds
out whole packages (all files of e.g. latex/acmart, so that near-copies of one template do not straddle
the split), chosen by a seeded hash of their name, until it has 5% of the tokens and at least 16
windows of 8192+1 tokens. Each document is followed by <|endoftext|> (50256); uint16.
"""
import argparse
import collections
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = 'texlive-science-doc,texlive-publishers-doc'

# -----------------------------------------------------------------------------------------------------
# The English filter: a stopword vote. About a third of the files are German, French, Italian,
# Portuguese, Spanish, Chinese, Persian, ... LaTeX commands and comments are removed, then the words are
# counted. A file is English when it has at least MIN_WORDS words, English stopwords are at least 5% of
# them and at least twice as frequent as the stopwords of the most frequent other language, and less
# than 5% of its letters are non-ASCII (this rejects CJK and Persian text with English markup). Measured
# on the two default packages (1515 files), the English share of stopwords is bimodal and the rejected
# files read as non-English or as markup without prose (tables, symbol lists, lorem ipsum).
STOPWORDS = {
    'en': "the of and to is that for it with be on by this are or an not from at which can we you if will have has was were also",
    'de': "der die das und ist nicht mit den von zu ein eine auf für sich dem des im auch werden wird oder bei sind als",
    'fr': "le la les et est une des du pour dans que qui sur pas au avec sont par ce cette aux il elle",
    'es': "el los las y es una del para por con que se al como su más lo",
    'it': "il della di che è per una con del sono non al nel gli degli alla",
    'pt': "os um uma para com não que do da dos das em por se ao",
}
STOPWORDS = {lang: set(words.split()) for lang, words in STOPWORDS.items()}
MIN_WORDS = 50


def is_english(text, min_words=MIN_WORDS):
    prose = re.sub(r'(?<!\\)%.*', '', text)        # comments
    prose = re.sub(r'\\[A-Za-z@]+', ' ', prose)     # control words
    words = [w.lower() for w in re.findall(r'[^\W\d_]+', prose)]
    if len(words) < min_words:
        return False
    counts = collections.Counter(words)
    score = {lang: sum(counts[w] for w in stop) for lang, stop in STOPWORDS.items()}
    english = score.pop('en')
    letters = [c for c in prose if c.isalpha()]
    non_ascii = sum(not c.isascii() for c in letters) / len(letters)
    return english >= 0.05 * len(words) and english >= 2 * max(score.values()) and non_ascii < 0.05


# -----------------------------------------------------------------------------------------------------

def fetch_debs(packages, raw_dir):
    """apt-get download the packages (no install) and dpkg -x them into raw_dir/tree; returns the tree."""
    tree = os.path.join(raw_dir, 'tree')
    marker = os.path.join(tree, '.complete-' + hashlib.sha1(','.join(packages).encode()).hexdigest()[:12])
    if os.path.exists(marker):
        return tree
    for tool in ('apt-get', 'dpkg'):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: fetching {packages} needs Debian/Ubuntu's apt-get and dpkg; "
                               f"elsewhere pass --src DIR with .tex files")
    os.makedirs(raw_dir, exist_ok=True)
    shutil.rmtree(tree, ignore_errors=True)
    for pkg in packages:
        debs = [f for f in os.listdir(raw_dir) if f.startswith(pkg + '_') and f.endswith('.deb')]
        if not debs:
            print(f"apt-get download {pkg} ...", flush=True)
            r = subprocess.run(['apt-get', 'download', pkg], cwd=raw_dir, capture_output=True, text=True)
            debs = [f for f in os.listdir(raw_dir) if f.startswith(pkg + '_') and f.endswith('.deb')]
            if r.returncode != 0 or not debs:
                raise RuntimeError(f"`apt-get download {pkg}` failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}\n"
                                   f"try `apt-get update` first, or pass --src DIR with .tex files")
        for deb in sorted(debs):
            subprocess.run(['dpkg', '-x', os.path.join(raw_dir, deb), tree], check=True)
    open(marker, 'w').close()
    return tree


def package_of(relpath):
    """The package folder of a file: 'latex/acmart' for usr/share/doc/texlive-doc/latex/acmart/samples/x.tex;
    for another tree, its first two folders (or fewer, for files near the top)."""
    parts = relpath.replace(os.sep, '/').split('/')
    if parts[:4] == ['usr', 'share', 'doc', 'texlive-doc']:
        parts = parts[4:]
    return '/'.join(parts[:min(2, len(parts) - 1)]) or relpath


def read_tex_tree(src):
    """[(relative path, text)] of every .tex and .tex.gz under src, sorted by path."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"source folder {src} does not exist")
    docs = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for fname in sorted(files):
            if fname.endswith(('.tex', '.tex.gz')):
                path = os.path.join(root, fname)
                with (gzip.open if fname.endswith('.gz') else open)(path, 'rb') as f:
                    docs.append((os.path.relpath(path, src), pc.decode_text(f.read())))
    docs.sort()
    if not docs:
        raise FileNotFoundError(f"no .tex or .tex.gz files under {src}")
    return docs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--src', default=None, help="folder tree of .tex/.tex.gz files (default: the Debian packages)")
    p.add_argument('--packages', default=PACKAGES,
                   help="comma-separated Debian packages to fetch (texlive-latex-extra-doc adds 593 MB / 27 MB of .tex)")
    p.add_argument('--val_fraction', type=float, default=0.05)
    p.add_argument('--min_val_tokens', type=int, default=pc.MIN_VAL_TOKENS)
    p.add_argument('--min_words', type=int, default=MIN_WORDS, help="shorter files are dropped")
    args = pc.parse_args(p, HERE, argv)

    packages = [x for x in args.packages.split(',') if x]
    source = 'apt:' + ','.join(packages) if args.src is None else os.path.abspath(args.src)
    config = {'format_version': pc.FORMAT_VERSION, 'source': source, 'val_fraction': args.val_fraction,
              'min_val_tokens': args.min_val_tokens, 'min_words': args.min_words, 'split': 'package',
              'seed': args.seed}
    if not args.force and pc.already_prepared(args.out_dir, config):
        print(f"{args.out_dir}: already prepared (use --force to redo)")
        return pc.read_meta(args.out_dir)

    t0 = time.time()
    src = args.src if args.src is not None else fetch_debs(packages, os.path.join(args.out_dir, 'raw'))
    docs = read_tex_tree(src)
    n_files, n_bytes = len(docs), sum(len(t) for _, t in docs)

    first = {}  # exact duplicates: keep the first by path
    for name, text in docs:
        first.setdefault(hashlib.sha256(text.encode('utf-8')).digest(), (name, text))
    unique = list(first.values())
    english = [(n, t) for n, t in unique if is_english(t, args.min_words)]
    print(f"{n_files} files ({n_bytes:,} chars): {n_files - len(unique)} exact duplicates, "
          f"{len(unique) - len(english)} not English or under {args.min_words} words, "
          f"{len(english)} kept ({sum(len(t) for _, t in english):,} chars)")
    if not english:
        raise ValueError(f"no English .tex documents of {args.min_words}+ words under {src}")

    # hold out whole packages: one package's files (often near-copies of one template) stay together
    n_tokens = [len(ids) + 1 for ids in pc.get_tokenizer('gpt2').encode_ordinary_batch([t for _, t in english])]
    group_tokens = collections.Counter()
    for (name, _), n in zip(english, n_tokens):
        group_tokens[package_of(name)] += n
    groups = sorted(group_tokens)
    val_groups = pc.split_documents(groups, [group_tokens[g] for g in groups], args.val_fraction,
                                    args.min_val_tokens, args.seed)
    val_names = {n for n, _ in english if package_of(n) in val_groups}
    with pc.DatasetWriter(args.out_dir, 'gpt2', config) as w:
        for split in ('train', 'val'):
            w.add(split, [t for n, t in english if (n in val_names) == (split == 'val')])
        meta = w.finish(source=source, val_packages=sorted(val_groups), val_documents=sorted(val_names))
    pc.print_summary(args.out_dir, meta, time.time() - t0)
    return meta


if __name__ == '__main__':
    main()
