"""
Prepare the Pile's ArXiv subset (raw LaTeX of papers) as GPT-2 BPE tokens (uint16, EOT 50256).

    python data/arxiv/prepare.py                           # shards in data/arxiv/raw/
    python data/arxiv/prepare.py --input /pile/train/00.jsonl.zst --val_input /pile/val.jsonl.zst
    python data/arxiv/prepare.py --hf_dataset NAME         # a Hugging Face copy, where one is reachable

Reads Pile-format shards ({"text": ..., "meta": {"pile_set_name": "ArXiv"}} a line; .jsonl, or
.jsonl.zst with `pip install zstandard`), streaming, and keeps the records whose pile_set_name is
"ArXiv". Options: `python data/arxiv/prepare.py --help`. Offline stand-in: data/texdoc.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/: prepare_common
import prepare_common as pc  # noqa: E402


def main(argv=None):
    return pc.pile_main('ArXiv', os.path.dirname(os.path.abspath(__file__)), argv)


if __name__ == '__main__':
    main()
