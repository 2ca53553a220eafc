"""
Prepare the Pile's Books3 subset (long books) as GPT-2 BPE tokens (uint16, EOT 50256).

    python data/books3/prepare.py                           # shards in data/books3/raw/
    python data/books3/prepare.py --input /pile/train/00.jsonl.zst --val_input /pile/val.jsonl.zst
    python data/books3/prepare.py --hf_dataset NAME         # a Hugging Face copy, where one is reachable

Reads Pile-format shards ({"text": ..., "meta": {"pile_set_name": "Books3"}} a line; .jsonl, or
.jsonl.zst with `pip install zstandard`), streaming, and keeps the records whose pile_set_name is
"Books3". Options: `python data/books3/prepare.py --help`. Offline stand-in: data/gutenberg.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402


def main(argv=None):
    return pc.pile_main('Books3', os.path.dirname(os.path.abspath(__file__)), argv)


if __name__ == '__main__':
    main()
