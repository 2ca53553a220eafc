"""
Sample from a trained model (nanoGPT's sample.py for these checkpoints).

    python sample.py --out_dir=out/dape_kerple
    python sample.py out/dape_kerple --start="It is a truth universally" --max_new_tokens=2000
    python sample.py out/dape_kerple --start=FILE:prompt.txt --num_samples=1 --temperature=0.7 --top_k=50

The tokenizer (bytes or GPT-2 BPE) comes from the dataset's meta.json, found through the checkpoint's
training config (or --data_dir=); without it, it is inferred from the vocabulary size. A dataset whose
tokenizer does not fit the model's vocabulary is an error, as are options out of range. Generation
goes through the model's KV cache one token at a time and is not cropped to the training length:
every encoding except `learned` keeps going past it, which is the point of these models.
"""

import math
import os
import sys

import torch

from common import InputError, autocast, load_run, pick_device, pick_dtype, resolve_data_dir, run_main
from configurator import configure
from positional import RoPE, set_rope_scaling
from tokenizer import get_tokenizer, load_meta, tokenizer_of_vocab

# -----------------------------------------------------------------------------
_names_before_config = set(globals())
out_dir = 'out'          # checkpoint directory (or a .pt file; a bare argument does the same)
data_dir = ''            # dataset with meta.json; '' -> from the checkpoint's training config
start = "\n"             # prompt; "FILE:path" reads it from a file; "" starts from the end-of-text token
num_samples = 3
max_new_tokens = 500
temperature = 0.8        # 1.0: the model's distribution; lower: more conservative; 0: greedy
top_k = 200              # keep only the top_k most likely tokens; 0: no cut
seed = 1337
device = 'auto'          # auto: cuda if available, else cpu
dtype = 'auto'           # auto: bfloat16 autocast on a GPU that supports it, else float32
compile = False          # torch.compile the model
rope_scaling = 'none'    # RoPE context extension (positional.py): none, pi, ntk, yarn
rope_scale = 0.0         # its factor s; 0 -> max(1, tokens fed / training length)
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]


def tokenizer_for(ckpt, model, data_dir_override=''):
    """The dataset's tokenizer (meta.json), or one inferred from the vocabulary when the dataset is
    not on this machine: 256 -> bytes, >= 50257 -> GPT-2 BPE. A dataset whose tokenizer cannot be the
    model's is an error: its ids would be fed to, or sampled from, the wrong embedding rows."""
    vocab = model.config.vocab_size
    try:
        data_dir = resolve_data_dir(ckpt, data_dir_override)
        tok = get_tokenizer(load_meta(data_dir))
    except (InputError, FileNotFoundError) as e:
        if data_dir_override:
            raise InputError(str(e)) from e
        name = tokenizer_of_vocab(vocab)
        if name is None:
            raise InputError(f"cannot tell the tokenizer: {e}; pass --data_dir=data/<name>") from e
        print(f"({e}; using the '{name}' tokenizer for vocab_size {vocab})", file=sys.stderr)
        return get_tokenizer(name)
    except ValueError as e:  # a meta.json that is not JSON, lacks keys, or names an unknown tokenizer
        raise InputError(f"cannot read the tokenizer from {data_dir}/meta.json: {e}") from e
    # the checkpoint does not name its tokenizer, but its vocabulary (the dataset's, or that padded up)
    # must hold the tokenizer's and, for the sizes that imply one, be that tokenizer's
    implied = tokenizer_of_vocab(vocab)
    if vocab < tok.vocab_size or implied not in (None, tok.name):
        trained_on = ckpt.get('dataset') or (ckpt.get('config') or {}).get('dataset')
        raise InputError(
            f"the model's vocabulary ({vocab}"
            + (f", the '{implied}' tokenizer's" if implied else '')
            + f") does not match the '{tok.name}' tokenizer (vocab {tok.vocab_size}) of {data_dir}/meta.json: "
            + "pass --data_dir=data/<name> of the dataset the model was trained on"
            + (f" (the checkpoint says '{trained_on}')" if trained_on else ''))
    return tok


def decode(tok, ids):
    """Text of ids. A model whose embedding is padded past the tokenizer's vocabulary (train.py's
    vocab_size=) can still sample a padding id, never seen in training: it is dropped, with a note."""
    bad = [i for i in ids if i >= tok.vocab_size]
    if bad:
        print(f"({len(bad)} sampled ids beyond the '{tok.name}' tokenizer's vocabulary of {tok.vocab_size} "
              f"(embedding padding) left out)", file=sys.stderr)
    return tok.decode([i for i in ids if i < tok.vocab_size])  # bytes: invalid utf-8 shows as U+FFFD


def check_options(cfg):
    """Options that would fail late or be silently misread fail here, before the checkpoint is loaded."""
    t = cfg['temperature']
    if not (math.isfinite(t) and t >= 0):
        raise InputError(f"--temperature must be >= 0 (0: greedy), got {t}")
    if cfg['top_k'] < 0:
        raise InputError(f"--top_k must be >= 1, or 0 for no cut, got {cfg['top_k']}")
    if cfg['num_samples'] < 1:
        raise InputError(f"--num_samples must be >= 1, got {cfg['num_samples']}")
    if cfg['max_new_tokens'] < 0:
        raise InputError(f"--max_new_tokens must be >= 0, got {cfg['max_new_tokens']}")
    if cfg['rope_scaling'] not in RoPE.SCALINGS:
        raise InputError(f"--rope_scaling must be one of {', '.join(RoPE.SCALINGS)}, got {cfg['rope_scaling']!r}")
    if cfg['rope_scale'] and (cfg['rope_scaling'] == 'none' or not cfg['rope_scale'] >= 1):
        raise InputError(f"--rope_scale={cfg['rope_scale']} needs --rope_scaling=pi, ntk or yarn and a value >= 1 "
                         f"(0: from the length)")


def read_prompt(text):
    if not text.startswith('FILE:'):
        return text
    path = text[5:]
    if not os.path.isfile(path):
        raise InputError(f"prompt file {path!r} not found")
    try:
        with open(path, 'r', encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"prompt file {path!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                         f"save it as UTF-8") from None
    except OSError as e:
        raise InputError(f"cannot read prompt file {path!r}: {e.strerror}") from None


def sample(cfg, path):
    """Print and return cfg['num_samples'] continuations of the prompt."""
    check_options(cfg)
    dev = pick_device(cfg['device'])  # a device this machine lacks is an error here, not a "bad checkpoint"
    torch.manual_seed(cfg['seed'])
    if 'cuda' in dev:
        torch.cuda.manual_seed(cfg['seed'])
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ctx = autocast(dev, pick_dtype(cfg['dtype'], dev))
    model, ckpt = load_run(path, dev)
    tok = tokenizer_for(ckpt, model, cfg['data_dir'])
    if model.config.rand_pos_eval:
        # its positions are drawn afresh at every forward, so the one-token steps of generate would fail
        model.config.rand_pos_eval = False
        print("(generating at positions 0, 1, 2, ... as with rand_pos_eval=False: the model's random "
              "evaluation positions cannot continue a KV cache)", file=sys.stderr)
    if cfg['compile']:
        model = torch.compile(model)

    ids = tok.encode(read_prompt(cfg['start'])) or [tok.eot_token]
    if max(ids) >= model.config.vocab_size:
        raise InputError(f"the prompt has token {max(ids)} but the model's vocabulary is {model.config.vocab_size}: "
                        f"wrong tokenizer/dataset? pass --data_dir=")
    # generate feeds the prompt and every new token but the last (which is only sampled), at positions
    # 0, 1, 2, ...: with no new token, nothing is fed
    fed = len(ids) + cfg['max_new_tokens'] - 1 if cfg['max_new_tokens'] else 0
    n_pos = model.pe[0].n_positions if model.config.pos == 'learned' else None
    if n_pos is not None and fed > n_pos:
        raise InputError(f"pos=learned encodes {n_pos} positions: a prompt of {len(ids)} tokens leaves room for "
                        f"{max(0, n_pos - len(ids) + 1)} new tokens, not --max_new_tokens={cfg['max_new_tokens']}")
    if cfg['rope_scaling'] != 'none':  # s from the longest sequence fed, unless given
        try:
            s = set_rope_scaling(model, cfg['rope_scaling'], cfg['rope_scale'], max(fed, 1))
        except ValueError as e:
            raise InputError(str(e)) from None
        print(f"(RoPE {cfg['rope_scaling']} scaling, s={s:g})", file=sys.stderr)
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None]
    samples = []
    with torch.no_grad(), ctx:
        for _ in range(cfg['num_samples']):
            y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'],
                               top_k=cfg['top_k'] or None)
            text = decode(tok, y[0].tolist())
            samples.append(text)
            print(text)
            print('---------------')
    return samples


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__.strip() + '\n')  # then the configurator lists the keys and exits
    bare = [a for a in argv if not a.startswith('-') and not a.endswith('.py')]  # .py: config files
    rest = [a for a in argv if a not in bare]
    cfg = configure({k: globals()[k] for k in config_keys}, rest)
    if len(bare) > 1:
        raise InputError(f"give one checkpoint, got {bare}")
    return sample(cfg, bare[0] if bare else cfg['out_dir'])


if __name__ == '__main__':
    run_main(main, 'sample.py')
