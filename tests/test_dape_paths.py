"""dape.py runs exactly as written: whether a fast path may run a DAPE module is decided by its code and
structure as they are in memory (dape_paths.py, fingerprint.py), not by a sample. An edit of dape.py, made
as a reader makes it (a copy of the file with the edit, imported), runs the plain form under auto with one
warning naming the part, the same gradients as the plain form, on the CPU path and where auto takes the
kernel (Triton's interpreter); forcing a fast path on it is an error; a comment or docstring edit keeps the
fast paths, quietly. Also: edits made in memory after a decision, one layer's module, a subclass; each kind
of change that touches no method's body (a subclass keeping its base's name, a wrapper, a global rebound,
library code patched, construction code, a part deleted, private attributes on the instance, the class
reassigned, global hooks, and where the kernel's check is the last line, a change the record cannot see),
planted, running exactly under auto and refused when a fast path is forced; what is not an edit keeping
the fast path; and what tells the kernel's calls apart."""

import functools
import importlib.util
import inspect
import itertools
import math
import os
import re
import statistics
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dape
import dape_paths
import dape_torch
import fingerprint
from model import GPT, GPTConfig

# every test here holds dape.py to the version the fast paths implement (tests/test_dape.py checks that record)
pytestmark = pytest.mark.recorded_dape
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


def test_the_fingerprint_reads_the_code_not_its_comments(tmp_path):
    """Comments and docstrings compile to nothing: no part changes. A one-character edit of code does."""
    same = edited(tmp_path, ('        """X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: the MLP over', '        """The MLP over'),
                  ("    def f(self, X, future=None):\n        \"\"\"X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: two",
                   "    def f(self, X, future=None):  # V2's\n        \"\"\"X [B, C, Tq, Tk] -> [B, H, Tq, Tk]: two"),
                  ("        if bias is None:\n            x, y, res_y = A, None, False  # A + f(A)",
                   "        # no bias: f sees A alone\n        if bias is None:\n            x, y, res_y = A, None, False"))
    for cls in ("DAPEV1", "DAPEV2"):
        assert fingerprint.definition([getattr(same, cls)]) == fingerprint.definition([getattr(dape, cls)])
    other = edited(tmp_path, ("x, y, res_y = A, None, False", "x, y, res_y = A, None, True"))
    assert fingerprint.definition([other.DAPEV1])["_DAPE._run"] != dape_torch.IMPLEMENTS["DAPEV1"]["_DAPE._run"]


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


@pytest.mark.parametrize("new", ['"b i j h -> b h i j") * 0.5', '"b i j h -> b h j i")'],
                         ids=["code", "a constant alone"])
def test_code_compiled_elsewhere_is_not_taken_for_the_file(new):
    """A __code__ compiled from other text that names dape.py and the same line: not the file's code."""
    fn = dape.DAPEV1.f
    text = "\n" * (fn.__code__.co_firstlineno - 1) + inspect.getsource(fn).replace('"b i j h -> b h i j")', new)
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
        # layer 0's fast path rounds its softmax over whole rows, the plain form over the keys a block sees
        assert torch.allclose(got[0], want[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(attn="stickbreaking"), dict(logn_scale="fixed")], ids=["stickbreaking", "logn"])
def test_the_torch_path_runs_under_another_normalisation(monkeypatch, kw):
    """dape_impl='torch' with stick-breaking or log-length scaling computes f on dape_torch's path, not the plain
    form's: their outputs are equal by test, so the calls are counted."""
    calls, real = [], dape_torch.residual_f
    monkeypatch.setattr(dape_torch, "residual_f", lambda *a, **k: calls.append(1) or real(*a, **k))
    step(model(dape, "torch", **kw), torch.randint(0, 32, (2, 19)))
    assert calls


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
    assert all(isinstance(w, list) for w in watched)
    assert sum(name == "__code__" for _, name, _ in watched[1]) >= 8  # the functions' code, watched


# -----------------------------------------------------------------------------
# what changes the computation without touching a method's body: each planted, it runs exactly


def dapes(m):
    return [block.attn.dape for block in m.transformer.h]


def planted(monkeypatch, plant, defining=dape, when="decided", kernel=False, **kw):
    """plant(models) changes the models auto, plain and torch (when "built", or "decided": after auto decided
    on the unchanged model), or what they are built from (when "before": plant(None)): under auto a training
    step then equals the plain form's, output and every gradient bit for bit, with one warning (returned),
    and the forced torch path refuses."""
    monkeypatch.setattr(dape_paths, "_warned", set())  # (a test may plant twice)
    if kernel:
        monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))
    x = torch.randint(0, 32, (2, 9))
    if when == "before":
        plant(None)
    models = [model(defining, impl, **{"n_layer": 1, **kw}) for impl in ("auto", "plain", "torch")]
    if when == "decided":
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error")
            models[0](x)  # decided: the fast path
    if when != "before":
        plant(models)
    with pytest.warns(UserWarning) as seen:
        got = step(models[0], x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Full backward hook is firing")  # PyTorch's, on the embedding
        want = step(models[1], x)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    messages = [str(w.message) for w in seen if str(w.message).startswith("DAPE")]
    assert len(messages) == 1, messages
    with pytest.raises(ValueError, match=r"dape_impl='torch' cannot run here: "):
        step(models[2], x)
    return messages[0]


def scaled(fn, by=1.5):
    return lambda *a, **k: by * fn(*a, **k)


@pytest.mark.parametrize("what", ["f", "__init__"])
def test_a_subclass_that_keeps_its_bases_name(monkeypatch, what):
    """class DAPEV1(dape.DAPEV1) overriding f, or __init__ (a Tanh where the base has a LeakyReLU, which
    the module built afresh by the same class has too)."""
    class DAPEV1(dape.DAPEV1):
        if what == "f":
            def f(self, X, future=None):
                return 1.5 * super().f(X, future)
        else:
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.mlp[1] = nn.Tanh()
    message = planted(monkeypatch, lambda models: None, types.SimpleNamespace(DAPEV1=DAPEV1), "built")
    assert f"two different objects are named DAPEV1.{what}" in message


def test_a_wrapped_method(tmp_path, monkeypatch):
    """Wrappers that carry __wrapped__, in memory after a decision: torch.no_grad()(f) (f's weights get no
    gradient), a functools.wraps wrapper of the same signature; and an assignment line at the end of
    dape.py that runs V2's f under bfloat16 autocast."""
    message = planted(monkeypatch, lambda models: monkeypatch.setattr(dape.DAPEV1, "f",
                                                                      torch.no_grad()(dape.DAPEV1.f)))
    assert message.startswith("DAPE: DAPEV1.f is not the dape.py")
    original = dape.DAPEV2.f

    @functools.wraps(original)
    def f(self, X, future=None):
        return 1.5 * original(self, X, future)
    message = planted(monkeypatch, lambda models: monkeypatch.setattr(dape.DAPEV2, "f", f), dape="v2")
    assert message.startswith("DAPE: DAPEV2.f is not the dape.py")
    last = "        return self.conv1.weight[:, :, 0], self.conv1.bias, self.conv2.weight[:, :, 0], self.conv2.bias\n"
    module = edited(tmp_path, (last, last + '\n\nDAPEV2.f = torch.autocast("cpu", torch.bfloat16)(DAPEV2.f)\n'))
    assert planted(monkeypatch, lambda models: None, module, "built", dape="v2").startswith(
        "DAPE: DAPEV2.f is not the dape.py")


def test_a_global_rebound_to_another_object_of_the_same_name(monkeypatch):
    """rearrange rebound to a function of the same name and module that scales its output."""
    import einops

    def rearrange(tensor, pattern):
        return 1.5 * einops.rearrange(tensor, pattern)
    rearrange.__module__ = einops.rearrange.__module__
    message = planted(monkeypatch, lambda models: monkeypatch.setattr(dape, "rearrange", rearrange))
    assert message.startswith("DAPE: rearrange is not what dape.py read when dape_paths.py was imported")


class LeakyReLU(nn.LeakyReLU):  # posing as PyTorch's
    __module__ = nn.LeakyReLU.__module__

    def forward(self, x):
        return F.leaky_relu(x, 0.3)


LIBRARY = {  # a patch of the library code that f's layers run: (patch, DAPE, the part named)
    "nn.LeakyReLU": (lambda mp: mp.setattr(nn, "LeakyReLU", LeakyReLU), "v1", "LeakyReLU"),
    "Linear.forward": (lambda mp: mp.setattr(nn.Linear, "forward", scaled(nn.Linear.forward)), "v1",
                       "Linear.forward"),
    "F.conv2d": (lambda mp: mp.setattr(F, "conv2d", scaled(F.conv2d)), "v2", "F.conv2d"),
    "Conv2d.forward's code": (lambda mp: mp.setattr(nn.Conv2d.forward, "__code__", (
        lambda self, input: 1.5 * self._conv_forward(input, self.weight, self.bias)).__code__), "v2",
        "Conv2d.forward.__code__"),
}


@pytest.mark.parametrize("case", list(LIBRARY))
def test_library_code_that_fs_layers_run_patched(monkeypatch, case):
    patch, which, part = LIBRARY[case]
    message = planted(monkeypatch, lambda models: patch(monkeypatch), when="before", dape=which)
    assert message.startswith("DAPE: ") and part in message


def test_a_library_patched_by_dape_py_itself(tmp_path, monkeypatch):
    """A line at the end of dape.py, which runs at its import, before dape_paths.py's import reads what
    dape.py's classes read from libraries (read here again, after importing the edited copy): LeakyReLU's
    forward replaced by a function of dape.py."""
    monkeypatch.setattr(nn.LeakyReLU, "forward", nn.LeakyReLU.forward)  # PyTorch's again after the test
    last = "        return self.conv1.weight[:, :, 0], self.conv1.bias, self.conv2.weight[:, :, 0], self.conv2.bias\n"
    module = edited(tmp_path, (last, last + "\n\nnn.LeakyReLU.forward = lambda self, x: F.leaky_relu(x, 0.3)\n"))
    with torch.device("meta"):
        seen = {c: fingerprint.library(getattr(module, c)(2)) for c in dape_paths.SEEN}
    monkeypatch.setattr(dape_paths, "SEEN", seen)
    assert "is not what dape.py read when dape_paths.py was imported" in planted(
        monkeypatch, lambda models: None, module, "built")


def test_code_that_runs_at_construction(tmp_path, monkeypatch):
    """A slope set in init_last_layer (an edit of dape.py), and V2's activation swapped by an
    init_last_layer replaced in memory: the module built afresh to compare with has them too."""
    module = edited(tmp_path, ('        if self.init != "zero":\n',
                               '        for m in self.modules():\n'
                               '            if isinstance(m, nn.LeakyReLU):\n'
                               '                m.negative_slope = 0.3\n'
                               '        if self.init != "zero":\n'))
    assert planted(monkeypatch, lambda models: None, module, "built").startswith(
        "DAPE: _DAPE.init_last_layer is not the dape.py")

    def init_last_layer(self):
        self.act = nn.Tanh()
    assert planted(monkeypatch, lambda models: monkeypatch.setattr(dape._DAPE, "init_last_layer", init_last_layer),
                   when="before", dape="v2").startswith(
        "DAPE: _DAPE.init_last_layer is not the dape.py")


def test_a_part_deleted(tmp_path, monkeypatch):
    """zero_future = True deleted from DAPEV2: the class then reads _DAPE's False (the fast paths would not
    zero the future; V2's f still does)."""
    module = edited(tmp_path, ("    zero_future = True\n\n", ""))
    message = planted(monkeypatch, lambda models: None, module, "built", dape="v2", pos="alibi")
    assert message.startswith("DAPE: DAPEV2.zero_future is not the dape.py")


INSTANCE = {  # private attributes set on an instance: (DAPE, module's path, name, value of it, the warning says)
    "_conv_forward": ("v2", "conv1", "_conv_forward",
                      lambda m: (lambda x, w, b: 1.5 * nn.Conv2d._conv_forward(m, x, w, b)), "has _conv_forward = "),
    "_compiled_call_impl": ("v1", "mlp.0", "_compiled_call_impl", lambda m: scaled(m.forward),
                            "has _compiled_call_impl = "),
    "_run": ("v1", "", "_run", lambda m: (lambda A, *a: type(m)._run(m, 1.5 * A, *a)), "has _run = "),
    "_forward_hooks": ("v1", "mlp.2", "_forward_hooks", lambda m: {0: lambda mod, args, y: 1.5 * y}, "mlp.2 has hooks"),
}


@pytest.mark.parametrize("case", list(INSTANCE))
def test_a_private_attribute_set_on_the_instance(monkeypatch, case):
    which, path, name, value, said = INSTANCE[case]

    def plant(models):
        for m in models:
            for d in dapes(m):
                layer = d.get_submodule(path)
                setattr(layer, name, value(layer))
    assert said in planted(monkeypatch, plant, dape=which)


def test_the_class_assigned_after_a_decision(monkeypatch):
    class Scaled(dape.DAPEV1):
        def f(self, X, future=None):
            return 1.5 * super().f(X, future)

    def plant(models):
        for m in models:
            for d in dapes(m):
                d.__class__ = Scaled
    assert "Scaled.f is not the dape.py" in planted(monkeypatch, plant)


@pytest.mark.parametrize("kind", ["full_backward_pre", "forward_pre", "forward"])
def test_global_module_hooks(monkeypatch, kind):
    """Hooks that PyTorch calls for every module, set after a decision, acting on LeakyReLU only."""
    register = getattr(nn.modules.module, f"register_module_{kind}_hook")
    hook = {"full_backward_pre": lambda m, g: tuple(1.5 * t for t in g) if isinstance(m, nn.LeakyReLU) else None,
            "forward_pre": lambda m, a: tuple(1.5 * t for t in a) if isinstance(m, nn.LeakyReLU) else None,
            "forward": lambda m, a, y: 1.5 * y if isinstance(m, nn.LeakyReLU) else None}[kind]
    handles = []
    try:
        message = planted(monkeypatch, lambda models: handles.append(register(hook)))
    finally:
        for h in handles:
            h.remove()
    assert message.startswith("DAPE: PyTorch's global module hooks are set")


def test_a_change_the_record_cannot_see_runs_the_plain_form_where_the_kernel_disagrees(monkeypatch):
    """A change that escaped the decision by code (planted: the decision blinded) where auto takes the
    kernel: its check disagrees, and so does the PyTorch path on the same inputs, so the calls run the plain
    form, with one warning naming both causes; forced, the kernel refuses."""
    monkeypatch.setattr(dape_paths, "code_differs", lambda module: None)
    monkeypatch.setattr(dape_paths, "KERNEL_DEVICES", ("cuda", "cpu"))
    x = torch.randint(0, 32, (2, 9))
    auto, plain, forced = (model(dape, impl, n_layer=1) for impl in ("auto", "plain", "triton"))
    for m in (auto, plain, forced):
        for d in dapes(m):
            d.mlp[1].negative_slope = 0.3
    with pytest.warns(UserWarning) as seen:
        got = step(auto, x)
    want = step(plain, x)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    messages = [str(w.message) for w in seen if str(w.message).startswith("DAPE")]
    assert len(messages) == 1 and re.match(
        r"DAPE: the fused kernel's y differs .*: the compiler \(dape_triton.py, on this device\) or a change of "
        r"dape.py that dape_paths.py cannot see; the PyTorch path's y differs .* too: running the plain form",
        messages[0]), messages
    dape_paths.VERDICTS.clear()
    with pytest.raises(ValueError, match=r"dape_impl='triton' cannot run here: the fused kernel's y differs"):
        step(forced, x)


LAYERS = {  # f's layers changed on the instance where no setting shows it: (change, what the warning names)
    "a layer added": (lambda d: d.mlp.append(nn.LeakyReLU(0.01)), "mlp.3: LeakyReLU where it builds nothing"),
    "a bias removed": (lambda d: setattr(d.mlp[2], "bias", None), "parameters {'weight': (3, 6), 'bias': None}"),
}


@pytest.mark.parametrize("case", list(LAYERS))
def test_layers_changed_where_no_setting_shows_it(monkeypatch, case):
    change, said = LAYERS[case]

    def plant(models):
        for m in models:
            for d in dapes(m):
                change(d)
    assert said in planted(monkeypatch, plant)


def test_the_globals_of_nested_functions_and_lambdas_are_read():
    code = compile("def f(x):\n    g = lambda t: SCALE * t\n    def h(t):\n        return math.exp(t)\n"
                   "    return g(h(x))\n", "<test>", "exec").co_consts[0]
    assert {("SCALE",), ("math",), ("math", "exp")} <= fingerprint.global_reads(code)


# -----------------------------------------------------------------------------
# what is not an edit: the fast path runs, quietly


def runs_fast(monkeypatch, plant, after=True, **kw):
    """With plant(models) on a model under auto and its plain twin: no warning, the fast path ran, and the
    two agree to float32 rounding."""
    calls = []
    real = dape_torch.residual_f
    monkeypatch.setattr(dape_torch, "residual_f", lambda *a: calls.append(1) or real(*a))
    x = torch.randint(0, 32, (2, 9))
    models = [model(dape, impl, **{"n_layer": 1, **kw}) for impl in ("auto", "plain")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if after:
            with torch.no_grad():
                models[0](x)
        plant(models)
        calls.clear()
        got, want = step(models[0], x), step(models[1], x)
    assert calls
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-4, atol=1e-6)


def test_a_comment_added_to_the_file_after_import(tmp_path, monkeypatch):
    module = edited(tmp_path)
    models = []
    monkeypatch.setattr(dape, "DAPEV1", module.DAPEV1)  # the models' DAPE, built after the file changed
    with open(module.__file__) as f:
        text = f.read()
    with open(module.__file__, "w") as f:
        f.write("# a comment, two lines above every function\n\n" + text)
    runs_fast(monkeypatch, models.extend, after=False)


def test_settings_and_hooks_that_change_nothing(monkeypatch):
    """An in-place LeakyReLU, a hook on the DAPE module itself (which neither path calls), and PyTorch's
    FlopCounterMode (global hooks that only record where a module runs)."""
    def plant(models):
        for m in models:
            for d in dapes(m):
                d.mlp[1].inplace = True
                d.register_forward_hook(lambda mod, args, y: 2 * y)
    runs_fast(monkeypatch, plant)
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        runs_fast(monkeypatch, lambda models: None, after=False)
    assert counter.get_total_flops() > 0


def test_bfloat16_autocast_on_the_cpu_differs_by_rounding_only():
    """Under bfloat16 autocast the plain form computes f's layers in bfloat16 and the CPU's fast path in
    float32: as dape_paths.py says, they differ by rounding: the loss by less than 0.1%, the median gradient
    by less than 2% of its size (root mean square; at least 1% of the largest gradient's, as b2's is zero in
    truth)."""
    x = torch.randint(0, 32, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16):
        (loss, grads), (want, wanted) = (step(model(dape, impl), x) for impl in ("auto", "plain"))
    rms = lambda t: t.float().pow(2).mean().sqrt().item()
    top = max(rms(w) for w in wanted.values())
    errors = [rms(grads[n] - wanted[n]) / max(rms(wanted[n]), 0.01 * top) for n in wanted]
    assert 0 < abs(loss - want) / want < 1e-3 and 0 < statistics.median(errors) < 0.02, (loss, want, errors)


# -----------------------------------------------------------------------------
# what tells the kernel's calls apart


def kernel_call(**change):
    """The arguments of dape_paths._kernel_key for a small call as model.py makes it, with some changed."""
    import dape_triton
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(dape_paths, "dape_triton", dape_triton)
    c = dict(B=2, H=2, Tq=19, Tk=19, hs=8, dtype=torch.float32, device="cpu", bias="shared", causal=True,
             q_offset=0, variant="concat_residual", D=8, dape="v1", layout="model", align=0, need_q=True,
             need_bias=False, frozen=False)
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
    bias = bias.to(c["device"]).requires_grad_(c["need_bias"]) if bias is not None else None
    module = (dape.DAPEV1(c["H"], c["D"], c["variant"], bias is not None) if c["dape"] == "v1" else
              dape.DAPEV2(c["H"], c["D"], 3, c["variant"], bias is not None))
    module.requires_grad_(not c["frozen"])
    if isinstance(c["frozen"], str):  # that parameter alone
        module.requires_grad_(True).get_parameter(c["frozen"]).requires_grad_(False)
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
    "f's parameters' gradients": ({}, dict(frozen=True)), "one parameter's gradient": ({}, dict(frozen="mlp.2.bias")),
    "the bias's gradient": ({}, dict(need_bias=True)),
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


def test_only_training_calls_join_the_ranks_verdict(monkeypatch):
    """Under torch.distributed the ranks agree on the kernel's verdict for training calls, which they make in
    lockstep; an evaluation call (grad disabled), which one rank may make alone, decides locally."""
    import dape_check
    reduced = []
    monkeypatch.setattr(dape_check, "check", lambda *a: (None, None))
    monkeypatch.setattr(dape_paths.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dape_paths.dist, "all_reduce", lambda t, op: reduced.append(t))
    call = kernel_call()
    with torch.no_grad():
        assert dape_paths._trust_kernel("evaluation", *call) is None and not reduced
    assert dape_paths._trust_kernel("training", *call) is None and len(reduced) == 1


EVAL_ALONE = """
import datetime, os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import dape_paths
from model import GPT, GPTConfig
rank, done = int(sys.argv[1]), {done!r}
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
dape_paths.KERNEL_DEVICES = ("cuda", "cpu")
if rank == 0:
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=8, pos="kerple", dape="v1"))
    with torch.no_grad():
        m(torch.randint(0, 32, (1, 9)))
    print("evaluated", list(dape_paths.VERDICTS.values()), flush=True)
    open(done, "w").close()
else:  # makes no call: a collective of rank 0's would wait for it
    while not os.path.exists(done):
        time.sleep(0.2)
dist.destroy_process_group()
"""


def test_an_evaluation_on_one_rank_alone_decides_alone(tmp_path):
    """Under torch.distributed an evaluation call (grad disabled) on rank 0 alone, rank 1 making none, decides
    the kernel's verdict on rank 0 without a collective, and finishes: one would wait for rank 1 for ever."""
    import subprocess
    import sys
    pytest.importorskip("triton")  # the kernel's path, under Triton's interpreter on a CPU
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = EVAL_ALONE.format(root=root, store=str(tmp_path / "store"), done=str(tmp_path / "done"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert "evaluated [None]" in out, err[-2000:]


def test_a_global_rebound_to_a_wrapper_of_the_library_function(monkeypatch):
    """rearrange rebound, before any decision, to a functools.wraps wrapper of einops.rearrange that scales its
    output: its name and module are the library's, as recorded; its __wrapped__ tells it from the record."""
    import einops

    @functools.wraps(einops.rearrange)
    def rearrange(tensor, pattern, **axes):
        return 1.5 * einops.rearrange(tensor, pattern, **axes)
    message = planted(monkeypatch, lambda models: monkeypatch.setattr(dape, "rearrange", rearrange), when="before")
    assert "rearrange is not the dape.py that the fast paths implement" in message, message


WRAPPED_BEFORE_IMPORT = """
import functools, sys, torch.nn as nn
sys.path.insert(0, {root!r})
real = nn.Linear.forward

@functools.wraps(real)
def forward(self, x):
    return 1.5 * real(self, x)
nn.Linear.forward = forward
import dape, dape_paths
print(dape_paths.code_differs(dape.DAPEV1(4)))
"""


def test_library_code_wrapped_before_the_import(tmp_path):
    """nn.Linear.forward wrapped (functools.wraps, its output scaled) before dape_paths is imported, so that what
    it saw then is the wrapper: its __wrapped__ shows it, and the module's code differs, naming it."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", WRAPPED_BEFORE_IMPORT.format(root=root)], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Linear.forward" in out.stdout, out.stdout
