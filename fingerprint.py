"""
What code runs, read from memory: fingerprints of Python functions by their syntax tree, and of a module's
structure, which dape_paths.py compares with the dape.py that the fast paths implement (and dape_triton.py
with its kernels). A function's is the syntax tree without docstrings (comments never reach the tree) of
the source in its file that compiles to its __code__ as it is now, and its defaults. A class's parts are the
attributes of each class of its MRO and the globals their functions read (F, and modules' attributes read
through them: F.softmax), followed into the functions of the same file.
"""

import ast
import builtins
import dis
import functools
import hashlib
import inspect
import itertools
import linecache
import textwrap
import types

import torch.nn as nn
from torch.utils.module_tracker import ModuleTracker

MISSING = object()  # what a mapping holds under a key it does not have
# what a class statement records about itself rather than what its instances compute
NOT_CODE = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
            "__firstlineno__", "__static_attributes__"}
# every kind of hook that PyTorch calls for every module (forward, backward, registration)
GLOBAL_HOOKS = [d for k, d in vars(nn.modules.module).items() if k.startswith("_global_") and isinstance(d, dict)]
OBSERVERS = (ModuleTracker._fw_pre_hook, ModuleTracker._fw_post_hook)  # FlopCounterMode's: they record only


def tree_hash(fn):
    """sha256 of the syntax tree (canonical, without docstrings) of the source that compiles to fn's code, and
    of fn's defaults, 16 hex digits; None where no source in fn's file, as it is now, compiles to it."""
    code = fn.__code__
    linecache.checkcache(code.co_filename)  # a file edited since it was read (autoreload)
    try:
        whole = _compile("".join(linecache.getlines(code.co_filename)), code.co_filename)
        same = next(c for c in _code_objects(whole) if _same(c, code))
        tree = ast.parse(textwrap.dedent(inspect.getsource(same)))  # that code's lines, wherever they are now
    except (StopIteration, OSError, TypeError, SyntaxError):
        return None
    text = canonical(without_docstrings(tree)) + repr((fn.__defaults__, fn.__kwdefaults__))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_compile = functools.lru_cache(maxsize=16)(lambda text, filename: compile(text, filename, "exec", dont_inherit=True))


def _code_objects(code):
    return [code] + [c for k in code.co_consts if isinstance(k, types.CodeType) for c in _code_objects(k)]


def _same(a, b):
    """Whether two code objects are the same code, on whatever lines (bytecode, names, constants' values)."""
    fields = lambda c: (getattr(c, "co_qualname", c.co_name), c.co_code, c.co_names, c.co_varnames, c.co_freevars,
                        len(c.co_consts))
    return fields(a) == fields(b) and all(
        _same(x, y) if isinstance(x, types.CodeType) else (type(x), repr(x)) == (type(y), repr(y))
        for x, y in zip(a.co_consts, b.co_consts))


def without_docstrings(tree):
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def canonical(node):
    """A syntax tree as text that Python versions agree on: ast.dump's differs between them (fields that
    newer versions add, such as type_params, or leave out when empty), so empty fields are left out here."""
    if isinstance(node, ast.AST):
        fields = ((f, getattr(node, f, None)) for f in node._fields if f not in ("ctx", "kind", "type_comment"))
        return f"{type(node).__name__}({', '.join(f'{f}={canonical(v)}' for f, v in fields if v not in (None, []))})"
    if isinstance(node, list):
        return f"[{', '.join(canonical(v) for v in node)}]"
    return repr(node)


@functools.lru_cache(maxsize=None)
def global_reads(code):
    """The globals that a code object (and the functions and lambdas inside it) reads, each a tuple with
    the attributes read straight after it: ('F',) and ('F', 'softmax') for F.softmax."""
    out, chain = set(), ()
    for i in dis.get_instructions(code):
        chain = (i.argval,) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME") else chain + (i.argval,) if \
            i.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain else ()
        out |= {chain} if chain else set()
    return frozenset(out.union(*(global_reads(c) for c in code.co_consts if isinstance(c, types.CodeType))))


def reads(classes, library=False):
    """(key, holder, name, value), value being holder's under name (a mapping's item or MISSING, or an
    object's attribute), for all that defines what instances of these classes compute: keys 'Class.name',
    and for globals their dotted name ('F.softmax'); with the module first for a library's classes; None
    where read (so watched) but not a part. The functions of the classes' files are followed."""
    todo, done = [], set()
    for klass in dict.fromkeys(k for cls in classes for k in cls.__mro__ if k not in (nn.Module, object)):
        where, attributes = f"{klass.__module__}:" if library else "", vars(klass)  # one view for all names
        yield None, klass, "__mro__", klass.__mro__
        for name, value in attributes.items():
            if name not in NOT_CODE:
                yield f"{where}{klass.__name__}.{name}", attributes, name, value
                todo += [value] if isinstance(value, types.FunctionType) else []
    while todo:
        fn = todo.pop()
        where = f"{fn.__module__}:" if library else ""
        # a functools.wraps wrapper has the name of the function it wraps, which may be read too: keys apart
        qualname = fn.__qualname__ + (" (a wrapper)" if hasattr(fn, "__wrapped__") else "")
        for name in ("__code__", "__defaults__", "__kwdefaults__")[:3 if fn.__code__.co_kwonlyargcount else 2]:
            yield f"{where}{qualname}.{name}" if library else None, fn, name, getattr(fn, name)
        for chain in sorted(global_reads(fn.__code__)):
            holder, value = fn.__globals__, fn.__globals__.get(chain[0], MISSING)
            if value is MISSING and len(chain) == 1 and hasattr(builtins, chain[0]):
                yield None, holder, chain[0], MISSING  # a global the file does not define: the builtin
                holder, value = vars(builtins), getattr(builtins, chain[0])
            for attr in chain[1:]:  # through modules only: what a class or an object holds is not followed
                holder, value = (vars(value), vars(value).get(attr, MISSING)) if isinstance(
                    value, types.ModuleType) else (None, None)
            if holder is not None:
                yield where + ".".join(chain), holder, chain[-1], value
            if isinstance(value, types.FunctionType) and value.__module__ == fn.__module__ and value not in done:
                done.add(value)
                todo.append(value)


def parts(classes, library=False):
    """reads() as a mapping key -> object; a ValueError where two different objects have one key."""
    out = {}
    for key, _, _, value in reads(classes, library):
        if key is not None and out.setdefault(key, value) is not value:
            raise ValueError(f"two different objects are named {key} (a subclass that keeps its base's name?)")
    return out


def definition(classes):
    """parts(classes) fingerprinted: a function of their files by tree_hash, anything with __wrapped__ as such,
    a module, class or function of a library (or a builtin) by package and name, anything else by repr."""
    own, out = {k.__module__ for cls in classes for k in cls.__mro__ if k not in (nn.Module, object)}, {}
    for name, value in parts(classes).items():
        package = (getattr(value, "__module__", None) or "builtins").split(".")[0]  # (its module varies)
        out[name] = f"wrapped {value!r}" if hasattr(value, "__wrapped__") else \
            tree_hash(value) if isinstance(value, types.FunctionType) and value.__module__ in own else \
            f"module {value.__name__}" if isinstance(value, types.ModuleType) else \
            f"{type(value).__name__} {package}.{value.__name__}" if isinstance(value, (
                type, types.FunctionType, types.BuiltinFunctionType)) else repr(value)
    return out


def library(module):
    """What the module's code and its layers' code read that lives elsewhere than the module's own files
    (modules, classes, functions and their code), by key, to be compared by identity; code from its own
    files found there, whenever it was put there, as a new object (so that it differs)."""
    own, mine = {k.__module__ for k in type(module).__mro__ if k not in (nn.Module, object)}, parts([type(module)])
    files = {v.__code__.co_filename for v in mine.values() if isinstance(v, types.FunctionType) and v.__module__ in own}
    out = {k: v for k, v in mine.items() if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType)) or
           (isinstance(v, types.FunctionType) and v.__module__ not in own)}
    out.update(parts([type(m) for m in module.modules() if m is not module], library=True))
    return {k: object() if getattr(getattr(v, "__code__", v), "co_filename", None) in files else v
            for k, v in out.items()}


def structure(module):
    """Per submodule: its name, type, settings (its own attributes but PyTorch's bookkeeping: the public
    ones, and any that shadows an attribute or a method of its class), its parameters' shapes and whether it
    has hooks (not the DAPE module's own: neither path calls it); then whether PyTorch has hooks for every
    module (but FlopCounterMode's)."""
    out = []
    for name, m in module.named_modules():
        settings = tuple((k, repr(v) if isinstance(v, (list, dict, set)) else v) for k, v in vars(m).items()
                         if _setting(m, k))
        params = tuple((k, None if p is None else tuple(p.shape)) for k, p in m._parameters.items())
        hooks = m is not module and bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or
                                         m._backward_pre_hooks)
        out.append((name, type(m), settings, params, hooks))
    return tuple(out), any(callable(h) and getattr(h, "__func__", None) not in OBSERVERS
                           for d in GLOBAL_HOOKS for h in d.values())


# eval() does not change f (no dropout); an in-place LeakyReLU computes the same on f's fresh tensors
_setting = lambda m, k: (k[0] != "_" or hasattr(type(m), k)) and k not in ("training", "inplace")  # noqa: E731


def watch(module):
    """All that the decision on module reads, for unchanged(): what mappings and objects hold under each name
    (or MISSING), each class's attributes, the sizes of attributes' and hooks' mappings, its modules' types."""
    held, attrs, sizes = {}, {}, [(d, len(d)) for d in GLOBAL_HOOKS]
    layers = [type(m) for m in module.modules() if m is not module]
    for _, holder, name, value in itertools.chain(reads([type(module)]), reads(layers, library=True)):
        if isinstance(holder, types.MappingProxyType):  # a class's, compared whole at C speed
            held[id(holder), None] = (holder, dict(holder))
        else:
            (held if isinstance(holder, dict) else attrs)[id(holder), name] = (holder, name, value)
    for m in module.modules():
        attrs.update({(id(m), k): (m, k, getattr(m, k)) for k in ("__class__", "__dict__")})
        held.update({(id(vars(m)), k): (vars(m), k, v) for k, v in vars(m).items() if k != "training"})
        held.update({(id(d), k): (d, k, v) for d in (m._modules, m._parameters) for k, v in d.items()})
        sizes += [(d, len(d)) for d in (vars(m), m._modules, m._parameters, m._forward_hooks, m._forward_pre_hooks,
                                        m._backward_hooks, m._backward_pre_hooks)]
    return list(held.values()), list(attrs.values()), sizes


def unchanged(watched):
    """Whether all that watch() saw is as it was, by identity: microseconds."""
    held, attrs, sizes = watched
    for entry in held:
        if (entry[0] != entry[1]) if len(entry) == 2 else (entry[0].get(entry[1], MISSING) is not entry[2]):
            return False
    return all(getattr(o, k) is v for o, k, v in attrs) and all(len(d) == n for d, n in sizes)
