"""
What a trained layer adds to its attention logits (DAPE paper, Figure 1 and Appendix I): for one query
position (default: the last token of an 8192-token window) and every head of the chosen layer(s),

    A        = q.k / sqrt(d_head)                   the content logits
    B        = the positional bias (Kerple, ALiBi, ...; for CoPE its contextual position term)
    f(A, B)  = the DAPE term (V1's MLP, V2's 1xk convolutions) = pre-softmax logits - A - B

across key positions, one panel per (head, term); plus heat maps of A, B and f over a short window
(all query rows of the first `heatmap_len` tokens), where local versus "anti-local" patterns show.

    python visualize.py out/dape_kerple                                   # layer 0, last of 8192
    python visualize.py out/dape_kerple --layers=0,5,11 --length=2048 --query=1000
    python visualize.py out/dape_kerple --random=True                      # random tokens, no data needed

The terms come from the model itself (probe.layer_terms: the layer's own qkv, scores and DAPE module) for the
chosen rows, fed with the layer's actual input, captured by a hook; the tests check that they give
back the layer's real output, so what is drawn is what the model computes. Writes PNGs and an .npz of the arrays to out_dir.
"""

import os
import sys

import numpy as np
import torch

from common import InputError, load_run, load_val, pick_device, resolve_data_dir, run_main
from configurator import configure
from probe import capture_layers, layer_terms
from results import new_figure

# -----------------------------------------------------------------------------
_names_before_config = set(globals())
ckpt = ''                # checkpoint dir or .pt (or give it as a bare argument)
data_dir = ''            # validation data; '' -> from the checkpoint's training config
random = False           # True: uniformly random tokens instead of a validation window
length = 8192            # window length (capped by the data; `learned` by its table)
query = -1               # query position within the window; negative counts from the end
layers = '0'             # comma-separated layer indices (negative from the end), or 'all'
heatmap_len = 64         # heat maps over the first this many tokens of the window; 0: none
seed = 1337              # seeds the window position / random tokens
device = 'auto'
out_dir = 'results'
config_keys = [k for k in globals() if k not in _names_before_config and not k.startswith('_')]


def term_names(model):
    cfg = model.config
    b = {'cope': 'CoPE position term', 'path': 'PaTH term (its logits - q·k/√d)',
         'path_fox': 'forget-gate bias B'}.get(cfg.pos, f"{cfg.pos} bias B")
    f = {'v1': 'DAPE term f(A, B)', 'v2': 'DAPE V2 term g(A, B)'}.get(cfg.dape)
    if f and cfg.dape_variant == 'bias_only':
        f = f.replace('(A, B)', '(B)')
    elif f and cfg.dape_variant == 'add_residual':
        f = f.replace('(A, B)', '(A + B)')
    return {'A': 'logits A = q·k/√d', 'B': b, 'f': f}


def plot_rows(terms, names, qpos, T, block_size, title, path):
    """One row per head, one column per term: the term's value against key position, for one query."""
    import matplotlib.pyplot as plt
    cols = [t for t in ('A', 'B', 'f') if terms[t] is not None]
    H = terms['A'].shape[0]
    fig, axes = new_figure(H, len(cols), (4.2 * len(cols), 1.9 * H + 0.8), sharex=True, layout='constrained')
    keys = np.arange(qpos + 1)
    for h in range(H):
        for c, t in enumerate(cols):
            ax = axes[h, c]
            ax.plot(keys, terms[t][h, 0, :qpos + 1].numpy(), linewidth=0.6, color=f"C{c}")
            if qpos + 1 > block_size:  # left of this line: distances >= block_size, never seen in training
                ax.axvline(qpos - block_size + 1, color='grey', linestyle=':', linewidth=1)
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
            if h == 0:
                ax.set_title(names[t], fontsize=9)
            if c == 0:
                ax.set_ylabel(f"head {h}", fontsize=9)
            if h == H - 1:
                ax.set_xlabel('key position j', fontsize=8)
    fig.suptitle(title + (f"\n(left of the dotted line: keys at distances >= the training length {block_size}, "
                          f"never seen in training)"
                          if qpos + 1 > block_size else ''), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmaps(terms, names, title, path):
    """One row per head, one column per term: [query, key] heat maps, future (masked) keys blank."""
    import matplotlib.pyplot as plt
    cols = [t for t in ('A', 'B', 'f') if terms[t] is not None]
    H, n = terms['A'].shape[0], terms['A'].shape[1]
    future = np.triu(np.ones((n, n), dtype=bool), 1)
    fig, axes = new_figure(H, len(cols), (3.6 * len(cols), 3.0 * H + 0.8), layout='constrained')
    for h in range(H):
        for c, t in enumerate(cols):
            ax = axes[h, c]
            img = np.ma.masked_array(terms[t][h].numpy(), mask=future)
            im = ax.imshow(img, cmap='viridis', interpolation='nearest', origin='upper')
            fig.colorbar(im, ax=ax, shrink=0.9).ax.tick_params(labelsize=6)
            ax.tick_params(labelsize=6)
            ax.set_title(f"head {h}: {names[t]}", fontsize=8)
            ax.set_xlabel('key position j', fontsize=7)
            ax.set_ylabel('query position i', fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_layers(text, n_layer):
    if str(text) == 'all':
        return list(range(n_layer))
    try:
        ids = [int(v) for v in str(text).replace(' ', '').split(',') if v]
    except ValueError:
        raise InputError(f"--layers takes comma-separated layer indices or 'all', got {text!r}") from None
    out = []
    for i in ids:
        if not -n_layer <= i < n_layer:
            raise InputError(f"--layers: layer {i} does not exist; the model has {n_layer} layers (0..{n_layer - 1})")
        out.append(i % n_layer)
    return sorted(set(out))


def visualize(cfg, path):
    dev = pick_device(cfg['device'])
    model, ck = load_run(path, dev)
    mc = model.config
    name = os.path.basename(os.path.dirname(os.path.abspath(model_path(path))))
    layer_ids = parse_layers(cfg['layers'], mc.n_layer)
    T = cfg['length']
    if mc.pos == 'learned' and T > model.pe[0].n_positions:
        print(f"pos=learned cannot run past {model.pe[0].n_positions} tokens: using a window of that length")
        T = model.pe[0].n_positions
    g = np.random.default_rng(cfg['seed'])
    if cfg['random']:
        tokens = g.integers(0, mc.vocab_size, size=T)
        source = 'random tokens'
    else:
        data, _ = load_val(resolve_data_dir(ck, cfg['data_dir']))
        if T > len(data):
            print(f"the validation split holds {len(data)} tokens: using a window of that length")
            T = len(data)
        start = int(g.integers(0, len(data) - T + 1))
        tokens = np.asarray(data[start:start + T], dtype=np.int64)
        source = f"validation tokens {start}..{start + T - 1}"
    if not -T <= cfg['query'] < T:
        raise InputError(f"--query={cfg['query']} is outside a window of {T} tokens")
    qpos = cfg['query'] % T
    idx = torch.as_tensor(tokens, dtype=torch.long, device=dev)[None]
    names = term_names(model)
    os.makedirs(cfg['out_dir'], exist_ok=True)
    written, arrays = [], {}

    caps = capture_layers(model, idx, layer_ids)
    for layer in layer_ids:
        c = caps[layer]
        terms = layer_terms(model.transformer.h[layer].attn, c['x'], c['pe'], c['pos_q'], [qpos])
        err = (terms['out'] - c['out'][0, qpos].float().cpu()).abs().max().item()
        scale = c['out'][0, qpos].abs().max().item()
        print(f"layer {layer}: recomputed attention output matches the model's to {err:.2e} (max |out| {scale:.2e})")
        if err > 1e-3 * scale + 1e-5:
            raise RuntimeError(f"layer {layer}: the recomputed attention differs from the model's by {err}: "
                               f"visualize.py no longer matches model.py's attention")
        title = (f"{name} ({mc.pos}, dape={mc.dape}): layer {layer}, query position {qpos} of a {T}-token "
                 f"window ({source}); training length {mc.block_size}")
        p = os.path.join(cfg['out_dir'], f"{name}_layer{layer}_q{qpos}_rows.png")
        plot_rows(terms, names, qpos, T, mc.block_size, title, p)
        written.append(p)
        arrays.update({f"layer{layer}_q{qpos}_{t}": terms[t][:, 0].numpy() for t in ('A', 'B', 'f', 'att')
                       if terms[t] is not None})

    n = min(cfg['heatmap_len'], T)
    if n > 0:
        caps = capture_layers(model, idx[:, :n], layer_ids)
        for layer in layer_ids:
            c = caps[layer]
            terms = layer_terms(model.transformer.h[layer].attn, c['x'], c['pe'], c['pos_q'],
                                list(range(n)))
            title = (f"{name} ({mc.pos}, dape={mc.dape}): layer {layer}, first {n} tokens of the window, "
                     f"all query rows (future keys blank)")
            p = os.path.join(cfg['out_dir'], f"{name}_layer{layer}_heatmap{n}.png")
            plot_heatmaps(terms, names, title, p)
            written.append(p)
            arrays.update({f"layer{layer}_heatmap_{t}": terms[t].numpy() for t in ('A', 'B', 'f') if terms[t] is not None})
    p = os.path.join(cfg['out_dir'], f"{name}_terms.npz")
    np.savez_compressed(p, tokens=tokens, **arrays)
    written.append(p)
    for w in written:
        print(f"wrote {w}")
    return written


def model_path(path):
    return os.path.join(path, 'ckpt.pt') if os.path.isdir(path) else path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__.strip() + '\n')  # then the configurator lists the keys and exits
    bare = [a for a in argv if not a.startswith('-') and not a.endswith('.py')]
    rest = [a for a in argv if a not in bare]
    cfg = configure({k: globals()[k] for k in config_keys}, rest)
    paths = bare + ([cfg['ckpt']] if cfg['ckpt'] else [])
    if len(paths) != 1:
        raise InputError(f"give one checkpoint (python visualize.py out/dape_kerple), got {paths or 'none'}")
    return visualize(cfg, paths[0])


if __name__ == '__main__':
    run_main(main, 'visualize.py')
