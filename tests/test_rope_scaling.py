"""RoPE context extension (positional.py): PI, NTK-aware and YaRN frequencies against values computed
here independently, the YaRN temperature, s = 1 leaving RoPE exactly as trained, set_rope_scaling on
a GPT, and sample.py's options."""
import math

import numpy as np
import pytest
import torch

from common import InputError
from model import GPT, GPTConfig
from positional import RoPE, rope_scaling_label, set_rope_scaling

HS, L, BASE = 16, 64, 10000.0  # head size d, training length L


def rope(hs=HS, block=L):
    return RoPE(GPTConfig(block_size=block, vocab_size=32, n_layer=1, n_head=2, n_embd=2 * hs, pos='rope'))


def theta(i, d=HS, base=BASE):
    return base ** (-2 * i / d)


def pi_expected(s):
    return [theta(i) / s for i in range(HS // 2)]


def ntk_expected(s):
    b = BASE * s ** (HS / (HS - 2))  # the NTK-aware base
    return [b ** (-2 * i / HS) for i in range(HS // 2)]


def yarn_expected(s, alpha=1.0, beta=32.0):
    out = []
    for i in range(HS // 2):
        wavelength = 2 * math.pi / theta(i)
        r = L / wavelength
        gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        out.append((1 - gamma) * theta(i) / s + gamma * theta(i))
    return out


@pytest.mark.parametrize('kind,expected', [('pi', pi_expected), ('ntk', ntk_expected), ('yarn', yarn_expected)])
def test_frequencies_equal_independent_values(kind, expected):
    pe = rope()
    pe.set_scaling(kind, 8.0)
    np.testing.assert_allclose(pe.frequencies().double().numpy(), expected(8.0), rtol=1e-6)


def test_known_frequencies_by_hand():
    pe = rope()
    # NTK keeps the highest frequency and divides the lowest by s
    pe.set_scaling('ntk', 8.0)
    f = pe.frequencies().double().numpy()
    assert f[0] == pytest.approx(1.0) and f[-1] == pytest.approx(BASE ** (-14 / 16) / 8, rel=1e-6)
    # YaRN at L = 64, d = 16: dimension 0 turns 64 / (2 pi) = 10.19 times, so gamma = (10.19 - 1) / 31
    # = 0.2963 and h = 0.7037 / 8 + 0.2963 = 0.3843; dimension 2 (wavelength 2 pi * 10) turns 1.019
    # times, gamma = 0.0006; dimension 3 turns < 1 time: plain interpolation
    pe.set_scaling('yarn', 8.0)
    f = pe.frequencies().double().numpy()
    assert f[0] == pytest.approx(0.38433, abs=1e-4)
    assert f[3] == pytest.approx(theta(3) / 8, rel=1e-6)
    # with a ramp every dimension clears (beta below the fastest's turns), YaRN keeps RoPE's frequencies
    pe.set_scaling('yarn', 8.0, alpha=0.0, beta=1e-9)
    np.testing.assert_allclose(pe.frequencies().numpy()[0], 1.0)


def complex_rotation(x, pos, freqs):
    """Rotation in complex numbers (GPT-NeoX layout): feature m and m + d/2 are z_m's real and imaginary parts."""
    x = x.double().numpy()
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * np.outer(pos, freqs))
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize('kind', ['pi', 'ntk', 'yarn'])
def test_rotation_uses_the_scaled_frequencies_and_yarn_temperature(kind):
    torch.manual_seed(0)
    pe = rope()
    x = torch.randn(1, 2, 9, HS)
    pos = torch.arange(100, 109)
    pe.set_scaling(kind, 4.0)
    freqs = {'pi': pi_expected, 'ntk': ntk_expected, 'yarn': yarn_expected}[kind](4.0)
    want = complex_rotation(x, pos.numpy(), freqs)
    if kind == 'yarn':
        want = want * (0.1 * math.log(4.0) + 1)  # sqrt(1/t) on q and k: the logits gain its square
    np.testing.assert_allclose(pe.rotate(x, pos).double().numpy(), want, rtol=1e-4, atol=1e-5)


def test_pi_is_positions_divided_by_s():
    torch.manual_seed(0)
    pe, plain = rope(), rope()
    x, pos = torch.randn(1, 2, 7, HS), torch.arange(0, 700, 100)
    pe.set_scaling('pi', 5.0)
    torch.testing.assert_close(pe.rotate(x, pos), plain.rotate(x, pos / 5.0), rtol=1e-5, atol=1e-5)


def tiny(pos='rope', **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=L, vocab_size=64, n_layer=2, n_head=2, n_embd=2 * HS, pos=pos, **kw)).eval()


@pytest.mark.parametrize('kind', ['none', 'pi', 'ntk', 'yarn'])
def test_scale_one_leaves_rope_exactly_unchanged(kind):
    model = tiny()
    idx = torch.randint(0, 64, (2, 3 * L))
    with torch.no_grad():
        before = model(idx, idx)[0]
        assert set_rope_scaling(model, kind, 1.0) == 1.0
        torch.testing.assert_close(model(idx, idx)[0], before, rtol=0, atol=0)
        # s = 0 derives s = max(1, length / block_size): 1 at the training length and below
        assert set_rope_scaling(model, kind, 0, length=L) == 1.0
        torch.testing.assert_close(model(idx, idx)[0], before, rtol=0, atol=0)
        # a real scaling changes the logits, and 'none' gives the trained model back exactly
        if kind != 'none':
            assert set_rope_scaling(model, kind, 0, length=4 * L) == 4.0
            assert not torch.allclose(model(idx, idx)[0], before)
        set_rope_scaling(model, 'none')
        torch.testing.assert_close(model(idx, idx)[0], before, rtol=0, atol=0)


def test_scaled_model_still_decodes_with_its_cache():
    model = tiny()
    set_rope_scaling(model, 'yarn', 4.0)
    idx = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        full = model(idx, idx)[0][0, -1]
    out = model.generate(idx[:, :12], 8, temperature=0)  # the cache path rotates with the same scaling
    assert out.shape == (1, 20)
    with torch.no_grad():
        cached_last, _ = model(idx)  # last position only
    torch.testing.assert_close(cached_last[0, -1], full, rtol=1e-5, atol=1e-5)


def test_errors():
    pe = rope()
    with pytest.raises(ValueError, match='unknown RoPE scaling'):
        pe.set_scaling('linear', 2.0)
    with pytest.raises(ValueError, match='>= 1'):
        pe.set_scaling('pi', 0.5)
    with pytest.raises(ValueError, match='alpha < beta'):
        pe.set_scaling('yarn', 2.0, alpha=32, beta=1)
    with pytest.raises(ValueError, match='RoPE models only'):
        set_rope_scaling(tiny('kerple'), 'yarn', 4.0)
    set_rope_scaling(tiny('kerple'), 'none')  # restoring is fine on any model
    assert rope_scaling_label('yarn', 8.0) == '+yarn(s=8)'
    assert rope_scaling_label('pi', 0, derived=True, block_size=64) == '+pi(s=L/64)'
    assert rope_scaling_label('none', 1.0) == ''


@pytest.mark.parametrize('alpha, beta', [(4.0, 4.0), (8.0, 2.0), (-1.0, 32.0)])
def test_yarn_ramp_checked_on_the_command_line(tmp_path, alpha, beta):
    """The evaluation scripts refuse a YaRN ramp without 0 <= alpha < beta (alpha == beta divides by
    zero) as a one-line input error, before any checkpoint is read; a valid ramp passes."""
    import eval_extrapolate
    import eval_passkey
    from common import rope_scaling_options
    base = dict(rope_scaling='none,yarn', rope_scale=0.0)
    assert rope_scaling_options(dict(base, yarn_alpha=0.0, yarn_beta=1e-9)) == ['none', 'yarn']
    with pytest.raises(InputError, match='0 <= alpha < beta'):
        rope_scaling_options(dict(base, yarn_alpha=alpha, yarn_beta=beta))
    empty = str(tmp_path)  # no checkpoint here: the ramp must be refused first
    for script in (eval_passkey, eval_extrapolate):
        with pytest.raises(InputError, match='0 <= alpha < beta') as e:
            script.main([empty, '--rope_scaling=yarn', f'--yarn_alpha={alpha}', f'--yarn_beta={beta}',
                         '--device=cpu', f'--out_dir={tmp_path}/out'])
        assert '\n' not in str(e.value)


# -----------------------------------------------------------------------------
# sample.py


def test_sample_with_rope_scaling(tmp_path, capsys):
    import dataclasses
    import sample as S
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16, pos='rope'))
    out = tmp_path / 'rope'
    out.mkdir()
    torch.save({'model': model.state_dict(), 'model_args': dataclasses.asdict(model.config), 'iter_num': 0},
               out / 'ckpt.pt')
    cfg = {k: getattr(S, k) for k in S.config_keys}
    cfg.update(device='cpu', num_samples=1, max_new_tokens=40, start='abc', temperature=0.0,
               data_dir='', rope_scaling='yarn')
    plain = S.sample({**cfg, 'rope_scaling': 'none'}, str(out))
    scaled = S.sample(cfg, str(out))
    assert '(RoPE yarn scaling, s=2.625)' in capsys.readouterr().err  # (3 + 40 - 1) / 16: the positions fed
    assert len(scaled[0]) and scaled[0].startswith('abc') and plain[0].startswith('abc')
    assert S.sample({**cfg, 'rope_scale': 1.0}, str(out)) == plain  # s = 1: the trained RoPE
    with pytest.raises(InputError, match='rope_scaling must be one of'):
        S.sample({**cfg, 'rope_scaling': 'linear'}, str(out))
    with pytest.raises(InputError, match='needs --rope_scaling'):
        S.sample({**cfg, 'rope_scaling': 'none', 'rope_scale': 4.0}, str(out))
    kerple = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16, pos='kerple'))
    (tmp_path / 'kerple').mkdir()
    torch.save({'model': kerple.state_dict(), 'model_args': dataclasses.asdict(kerple.config), 'iter_num': 0},
               tmp_path / 'kerple' / 'ckpt.pt')
    with pytest.raises(InputError, match='RoPE models only'):
        S.sample(cfg, str(tmp_path / 'kerple'))


def test_a_yarn_ramp_without_yarn_is_refused():
    """--yarn_alpha and --yarn_beta change only YaRN's reading: given without --rope_scaling=yarn they would change
    nothing, so they are refused, as --rope_scale is without a scaling."""
    from common import rope_scaling_options
    base = dict(rope_scaling='none,pi', rope_scale=0.0, yarn_alpha=1.0, yarn_beta=32.0)
    assert rope_scaling_options(base) == ['none', 'pi']
    with pytest.raises(InputError, match='no effect without --rope_scaling=yarn'):
        rope_scaling_options(dict(base, yarn_alpha=5.0, yarn_beta=50.0))
