"""dape.py runs exactly as written: whether a fast path may run a DAPE module is decided by its code and
structure as they are in memory (dape_paths.py, fingerprint.py), not by a sample. An edit of dape.py, made
as a reader makes it (a copy of the file with the edit, imported), runs the plain form under auto with one
warning naming the part, the same gradients as the plain form, on the CPU path and where auto takes the
kernel (Triton's interpreter); forcing a fast path on it is an error; a comment or docstring edit keeps the
fast paths, quietly. Also: edits made in memory after a decision, one layer's module, a subclass, and what
tells the kernel's calls apart."""

import importlib.util
import inspect
import itertools
import math
import os
import re
import warnings

import pytest
import torch
import torch.nn as nn

import dape
import dape_paths
import dape_torch
import fingerprint
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(block_size=8, vocab_size=32, n_layer=2, n_head=3, n_embd=12, dape_width=6)
_loaded = itertools.count()


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(dape_paths, "VERDICTS", {})
    monkeypatch.setattr(dape_paths, "_warned", set())


def edited(tmp_path, *edits):
    """dape.py with each (old, new) text replaced once, imported from a file of its own: what a reader's edit
    of dape.py is to the process that imports it."""
    text = open(os.path.join(ROOT, "dape.py")).read()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / f"dape_edited_{next(_loaded)}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model(defining, impl, seed=0, **kw):
    """A tiny model whose DAPE modules are the classes of the module `defining` (dape.py or an edited copy),
    with the same weights whatever the impl."""
    cfg = {**TINY, "pos": "kerple", "dape": "v1", **kw}
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**cfg, dape_impl=impl))
    for block in m.transformer.h:
        old = block.attn.dape
        args = {p: getattr(old, p) for p in list(inspect.signature(type(old).__init__).parameters)[1:]}
        block.attn.dape = getattr(defining, type(old).__name__)(**args)
        block.attn.dape.load_state_dict(old.state_dict())
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def step(m, x):
    m.zero_grad(set_to_none=True)
    _, loss = m(x, x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def runs_as_plain(module, x, kernel, monkeypatch, autocast=None, **kw):
    """Under auto (where it would take the kernel, if kernel), a training step of a model of module's classes
    equals the plain form's, bit for bit, with one warning; returns the warning."""
    if kernel:
        monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))
    auto, plain = model(module, "auto", **kw), model(module, "plain", **kw)
    ctx = torch.autocast("cpu", autocast) if autocast else torch.autocast("cpu", enabled=False)
    with pytest.warns(UserWarning) as seen, ctx:
        got = step(auto, x)
    with warnings.catch_warnings(), ctx:
        warnings.simplefilter("error")
        want = step(plain, x)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    messages = [str(w.message) for w in seen if str(w.message).startswith("DAPE")]
    assert len(messages) == 1, messages
    return messages[0]


# -----------------------------------------------------------------------------
# the recorded fingerprint


def test_the_fast_paths_record_the_dape_py_they_implement():
    """dape_torch.IMPLEMENTS is dape.py's definition as it is: whoever changes dape.py updates it, together
    with the fast paths, once their equality tests (tests/test_dape.py, tests/test_dape_triton.py) pass."""
    now = {**fingerprint.definition(dape.DAPEV1, dape_paths.METHODS),
           **fingerprint.definition(dape.DAPEV2, dape_paths.METHODS)}
    assert now == dape_torch.IMPLEMENTS, "dape_torch.IMPLEMENTS should now read:\n" + \
        "\n".join(f'    "{k}": "{v}",' for k, v in now.items())
    for cls in (dape.DAPEV1, dape.DAPEV2):
        assert dape_paths.code_differs(cls(4)) is None


def test_the_fingerprint_reads_the_code_not_its_comments(tmp_path):
    """Comments and docstrings compile to nothing: no part changes. A one-character edit of code does."""
    same = edited(tmp_path, ('        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: the MLP over', '        """The MLP over'),
                  ("    def f(self, X, future=None):\n        \"\"\"X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: two",
                   "    def f(self, X, future=None):  # V2's\n        \"\"\"X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: two"),
                  ("        if bias is None:\n            x, y, res_y = A, None, False  # A + f(A)",
                   "        # no bias: f sees A alone\n        if bias is None:\n            x, y, res_y = A, None, False"))
    for cls in ("DAPEV1", "DAPEV2"):
        assert fingerprint.definition(getattr(same, cls), dape_paths.METHODS) == \
            fingerprint.definition(getattr(dape, cls), dape_paths.METHODS)
    other = edited(tmp_path, ("x, y, res_y = A, None, False", "x, y, res_y = A, None, True"))
    assert fingerprint.definition(other.DAPEV1, dape_paths.METHODS)["_DAPE._run"] != \
        dape_torch.IMPLEMENTS["_DAPE._run"]


# -----------------------------------------------------------------------------
# edits of dape.py, as a reader makes them


HELD_OUT = {  # edits that the fingerprint was not written around: each runs exactly
    "residual halved": (dict(dape="v1"), "_DAPE.residual_f",
                        ("logits = self.f(X, future) + (x + y if res_y else x)",
                         "logits = self.f(X, future) + 0.5 * (x + y if res_y else x)")),
    "softmax temperature": (dict(dape="v2"), "finish",
                            ('return F.softmax(logits, dim=-1) if out == "probs" else logits',
                             'return F.softmax(logits / 1.3, dim=-1) if out == "probs" else logits')),
    "Tanh in V1": (dict(dape="v1"), "DAPEV1.__init__",
                   ("nn.LeakyReLU(SLOPE),\n", "nn.Tanh(),\n")),
    "add_residual subtracts": (dict(dape="v2", dape_variant="add_residual"), "_DAPE._run",
                               ("x, y, res_y = A + bias, None, False", "x, y, res_y = A - bias, None, False")),
    "V2's future kept": (dict(dape="v2", pos="alibi"), "DAPEV2.f",
                         ("return self.conv2(zero(self.act(self.conv1(zero(X)))))",
                          "return self.conv2(self.act(self.conv1(zero(X))))")),
}


@pytest.mark.parametrize("kernel", [False, True], ids=["cpu", "kernel"])
@pytest.mark.parametrize("case", list(HELD_OUT))
def test_an_edit_of_dape_py_runs_exactly(tmp_path, monkeypatch, case, kernel):
    kw, part, edit = HELD_OUT[case]
    module = edited(tmp_path, edit)
    message = runs_as_plain(module, torch.randint(0, 32, (2, 19)), kernel, monkeypatch, **kw)
    assert message == f"DAPE: {part} is not the dape.py that the fast paths implement (edited?): running the " \
                      f"plain form (dape.py) for these calls"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_forcing_a_fast_path_on_an_edited_f_is_an_error(tmp_path, impl):
    module = edited(tmp_path, HELD_OUT["residual halved"][2])
    m = model(module, impl)
    x = torch.randint(0, 32, (1, 9))
    with pytest.raises(ValueError, match=rf"dape_impl='{impl}' cannot run here: _DAPE.residual_f is not the "
                                         rf"dape.py that the fast paths implement"):
        m(x, x)


@pytest.mark.parametrize("kernel", [False, True], ids=["cpu", "kernel"])
def test_comment_and_docstring_edits_keep_the_fast_paths(tmp_path, monkeypatch, kernel):
    module = edited(tmp_path, ('    """The variant logic shared by V1 and V2; subclasses define f."""',
                               '    """Shared by V1 and V2."""\n    # f comes from the subclass'),
                    ("        return finish(logits, future, out)\n\n    def reset",
                     "        return finish(logits, future, out)  # masked, or softmaxed\n\n    def reset"))
    if kernel:
        monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))
        import dape_triton
        ran = []
        real = dape_triton.attention
        monkeypatch.setattr(dape_triton, "attention", lambda *a, **k: ran.append(1) or real(*a, **k))
    else:
        ran = []
        real = dape_torch.residual_f
        monkeypatch.setattr(dape_torch, "residual_f", lambda *a, **k: ran.append(1) or real(*a, **k))
    m = model(module, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(m, torch.randint(0, 32, (2, 19)))
    assert ran


def test_an_edit_that_acts_on_large_values_runs(tmp_path, monkeypatch):
    """f clamped from below: ALiBi's steepest head passes -8 at distance 32, which the old sample (40 keys)
    never reached. The step's every gradient, f's first layer in layer 0 among them, is the plain form's."""
    module = edited(tmp_path, ('        return rearrange(self.mlp(rearrange(X, "b c i j -> b i j c")), "b i j h -> b h i j")',
                               '        X = X.clamp(min=-8.0)\n'
                               '        return rearrange(self.mlp(rearrange(X, "b c i j -> b i j c")), "b i j h -> b h i j")'))
    runs_as_plain(module, torch.randint(0, 32, (1, 64)), False, monkeypatch, pos="alibi", n_head=4, n_embd=16)


def test_a_random_edit_runs(tmp_path):
    """Dropout in f: two training steps with different seeds differ (the edit runs), and with one seed the
    step is the plain form's."""
    module = edited(tmp_path, ('    def f(self, X, future=None):\n        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: the MLP',
                               '    def f(self, X, future=None):\n        X = F.dropout(X, 0.1, self.training)\n'
                               '        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: the MLP'))
    m, plain = model(module, "auto"), model(module, "plain")
    x = torch.randint(0, 32, (2, 19))
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, which in ((1, m), (2, m), (1, plain)):
            torch.manual_seed(seed)
            losses.append(step(which, x)[0])
    assert losses[0] != losses[1] and torch.equal(losses[0], losses[2])


@pytest.mark.parametrize("edit,part", [(("SLOPE = 0.01", "SLOPE = 0.1"), "_DAPE.slope"),
                                       (("        residual_f = residual_f or self.residual_f\n",
                                         "        residual_f = residual_f or self.residual_f\n        A = 0.8 * A\n"),
                                        "_DAPE._run")])
def test_edits_the_kernel_copies_run_in_bfloat16(tmp_path, monkeypatch, edit, part):
    """The kernel has its own SLOPE and its own variant logic: edits of dape.py's run, under bfloat16
    autocast where auto would take the kernel (the 0.2 tolerance of the old check let both pass)."""
    message = runs_as_plain(edited(tmp_path, edit), torch.randint(0, 32, (2, 19)), True, monkeypatch,
                            autocast=torch.bfloat16)
    assert message.startswith(f"DAPE: {part} is not the dape.py")


# -----------------------------------------------------------------------------
# edits in memory, after a decision


def test_a_code_swap_after_a_decision_runs(tmp_path, monkeypatch):
    """As IPython's autoreload does it: the file edited, then the function's __code__ replaced by the new
    file's. Models built before and after the swap both run the new f."""
    module = edited(tmp_path)
    before, plain = model(module, "auto"), model(module, "plain")
    x = torch.randint(0, 32, (2, 19))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(before, x)  # decided: the fast path
    path = module.__file__
    text = open(path).read().replace('"b i j h -> b h i j")', '"b i j h -> b h i j") * 0.5')
    with open(path, "w") as f:
        f.write(text)
    namespace = {}
    exec(compile(text, path, "exec"), module.__dict__, namespace)
    monkeypatch.setattr(module.DAPEV1.f, "__code__", namespace["DAPEV1"].f.__code__)
    after = model(module, "auto")
    with pytest.warns(UserWarning, match="DAPEV1.f is not the dape.py"):
        got = [step(m, x) for m in (before, after)]
    want = step(plain, x)
    for g in got:
        assert torch.equal(g[0], want[0]) and all(torch.equal(g[1][n], want[1][n]) for n in want[1])


def test_code_compiled_elsewhere_is_not_taken_for_the_file():
    """A __code__ compiled from other text that names dape.py and the same line: not the file's code."""
    fn = dape.DAPEV1.f
    text = "\n" * (fn.__code__.co_firstlineno - 1) + \
        inspect.getsource(fn).replace('"b i j h -> b h i j")', '"b i j h -> b h i j") * 0.5')
    namespace = {}
    exec(compile("class DAPEV1:\n" + text, dape.__file__, "exec"), dape.__dict__, namespace)
    swapped = type(fn)(namespace["DAPEV1"].f.__code__, dape.__dict__)
    assert fingerprint.tree_hash(swapped) is None and fingerprint.tree_hash(fn) is not None


def test_one_layers_module_edited(monkeypatch):
    """A Tanh swapped into layer 1's f only, or its slope changed, after a first step: layer 1 runs the plain
    form from then on, layer 0 the fast path, and the model computes what the plain form computes with the
    same edit."""
    calls = []
    real = dape_torch.residual_f
    monkeypatch.setattr(dape_torch, "residual_f", lambda mod, *a: calls.append(mod) or real(mod, *a))
    x = torch.randint(0, 32, (2, 19))
    for edit, said in ((lambda f: f.mlp.__setitem__(1, nn.Tanh()), "mlp.1: Tanh where it builds mlp.1: LeakyReLU"),
                       (lambda f: setattr(f.mlp[1], "negative_slope", 0.1),
                        "mlp.1 has negative_slope = 0.1 (dape.py: 0.01)")):
        dape_paths._warned.clear()
        m, plain = model(dape, "auto"), model(dape, "plain")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(m, x)  # decided: the fast path, for both layers
        for which in (m, plain):
            edit(which.transformer.h[1].attn.dape)
        calls.clear()
        with pytest.warns(UserWarning, match=re.escape(f"DAPE: f's layers differ from what dape.py builds: {said}")):
            got = step(m, x)
        want = step(plain, x)
        assert calls and all(mod is m.transformer.h[0].attn.dape for mod in calls)
        assert torch.equal(got[0], want[0])


def test_a_subclass_that_overrides_f_runs():
    class Doubled(dape.DAPEV1):
        def f(self, X, future=None):
            return 2 * super().f(X, future)

    plain = model(dape, "plain")
    m = model(dape, "auto")
    for a, b in zip(m.transformer.h, plain.transformer.h):
        for block in (a, b):
            old = block.attn.dape
            block.attn.dape = Doubled(old.n_head, old.width, old.variant, old.has_bias)
            block.attn.dape.load_state_dict(old.state_dict())
    x = torch.randint(0, 32, (2, 19))
    with pytest.warns(UserWarning, match=r"DAPE: .*Doubled\.f is not the dape.py"):
        got = step(m, x)
    assert torch.equal(got[0], step(plain, x)[0])


def test_a_hook_or_a_method_set_on_the_instance_is_an_edit():
    m = dape.DAPEV1(4)
    assert dape_paths.code_differs(m) is None
    handle = m.mlp[2].register_forward_hook(lambda mod, inp, out: 2 * out)
    assert "mlp.2 has hooks" in dape_paths.code_differs(m)
    handle.remove()
    assert dape_paths.code_differs(m) is None
    m.residual_f = lambda *a: None
    assert "residual_f = " in dape_paths.code_differs(m)


def test_a_decision_costs_little():
    """The cached decision reads identities only; what it costs per call is measured in bench.py."""
    m = dape.DAPEV2(4)
    dape_paths.code_differs(m)
    watched = dape_paths.CODE[m][0]
    assert fingerprint.unchanged(watched)
    assert all(isinstance(w, list) for w in watched) and len(watched[2]) >= 8  # the functions' code, watched


# -----------------------------------------------------------------------------
# what tells the kernel's calls apart


def kernel_call(**change):
    """The arguments of dape_paths._kernel_key for a small call as model.py makes it, with some changed."""
    import dape_triton
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(dape_paths, "dape_triton", dape_triton)
    c = dict(B=2, H=2, Tq=19, Tk=19, hs=8, dtype=torch.float32, device="cpu", bias="shared", causal=True,
             q_offset=0, variant="concat_residual", D=8, dape="v1", layout="model", align=0, need_q=True,
             frozen=False)
    c.update(change)
    g = torch.Generator().manual_seed(0)

    def tensor(*shape):  # align: the data 4 bytes past a 16-byte boundary, nothing else changed
        return torch.randn(math.prod(shape) + c["align"], generator=g)[c["align"]:].view(shape)
    if c["layout"] == "model":  # transposed views of [B, T, H, hs], as model.py's rearrange leaves them
        q, k, v = (tensor(c["B"], T, c["H"], c["hs"]).transpose(1, 2) for T in (c["Tq"], c["Tk"], c["Tk"]))
    else:
        q, k, v = (tensor(c["B"], c["H"], T, c["hs"]) for T in (c["Tq"], c["Tk"], c["Tk"]))
    q, k, v = (t.to(c["dtype"]).to(c["device"]) for t in (q, k, v))
    q.requires_grad_(c["need_q"])
    bias = {"shared": lambda: tensor(1, c["H"], c["Tq"], c["Tk"]), None: lambda: None,
            "per sequence": lambda: tensor(c["B"], c["H"], c["Tq"], c["Tk"])}[c["bias"]]()
    bias = bias.to(c["device"]) if bias is not None else None
    module = (dape.DAPEV1(c["H"], c["D"], c["variant"], bias is not None) if c["dape"] == "v1" else
              dape.DAPEV2(c["H"], c["D"], 3, c["variant"], bias is not None))
    module.requires_grad_(not c["frozen"])
    return module, q, k, v, bias, c["causal"], c["q_offset"]


# One call that differs from another in one thing only (in what Triton specializes on, the lengths, strides
# and pointers, too: a field of the key that another field implies could not be told apart by such a test)
KEY_FIELDS = {
    "dtype": ({}, dict(dtype=torch.bfloat16)),
    "head size": ({}, dict(hs=24)), "heads": ({}, dict(H=4)), "f's width": ({}, dict(D=16)),
    "V2's kernel": ({}, dict(dape="v2")), "variant": ({}, dict(variant="concat")),
    "bias form": ({}, dict(bias="per sequence")), "mask": ({}, dict(causal=False)),
    "query length's class": (dict(bias=None), dict(Tq=32)), "key length's class": (dict(bias=None), dict(Tk=32)),
    "offset's class": ({}, dict(q_offset=1)), "strides": ({}, dict(layout="contiguous")),
    "pointer alignment": ({}, dict(align=1)), "an input's gradient": ({}, dict(need_q=False)),
    "f's parameters' gradients": ({}, dict(frozen=True)),
}


@pytest.mark.parametrize("field", list(KEY_FIELDS))
def test_every_field_of_the_kernels_key_tells_calls_apart(field):
    common, change = KEY_FIELDS[field]
    assert dape_paths._kernel_key(*kernel_call(**common, **change)) != dape_paths._kernel_key(*kernel_call(**common))


def test_the_device_tells_calls_apart():
    """(Read by dape_triton.binary: on a CPU, the other device at hand is 'meta', where autocast is not
    defined.)"""
    import dape_triton
    binary = lambda module, q, k, v, bias, causal, q_offset: dape_triton.binary(
        q, k, v, bias, module.weights()[0], module.variant, causal, q_offset)
    assert binary(*kernel_call(device="meta")) != binary(*kernel_call())


@pytest.mark.parametrize("mode", ["grad", "autocast"])
def test_grad_mode_and_autocast_tell_calls_apart(mode):
    base = dape_paths._kernel_key(*kernel_call())
    ctx = torch.no_grad() if mode == "grad" else torch.autocast("cpu", torch.bfloat16)
    with ctx:
        assert dape_paths._kernel_key(*kernel_call()) != base


def test_the_checks_lengths_keep_their_triton_class():
    import dape_triton
    for n in range(0, 400):
        cut = dape_triton.same_class(n, 40)
        assert dape_triton.specialization(cut) == dape_triton.specialization(n) and cut <= max(n, 40) and \
            (cut == n or cut <= 47), n
