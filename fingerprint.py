"""
What code runs, read from memory: fingerprints of Python functions by their syntax tree, and of a module's
structure. dape_paths.py compares a DAPE module's with the version of dape.py that the fast paths implement;
dape_triton.source_hash() fingerprints the kernels that docs/gpu.md's tables describe.

A function's fingerprint is its syntax tree without docstrings (comments never reach the tree), read through
its __code__ as it is now (so a swapped __code__, or a file edited since it was read, counts), or None where
its source cannot be read. A class's definition (definition) is every method named on it and on its
bases up to torch.nn.Module, their class attributes, and the globals those methods read, followed into the
functions of the same file: a global replaced at run time counts too.
"""

import ast
import builtins
import dis
import functools
import hashlib
import inspect
import linecache
import textwrap
import types

import torch.nn as nn

MISSING = object()  # what a mapping holds under a key it does not have


def tree_hash(fn):
    """sha256 of fn's syntax tree without docstrings (canonical), 16 hex digits; None where fn's code is not
    what its file, as it is now, compiles to (code compiled from elsewhere, or a file without source)."""
    linecache.checkcache(fn.__code__.co_filename)  # a file edited since it was read (autoreload)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        whole = _compile("".join(linecache.getlines(fn.__code__.co_filename)), fn.__code__.co_filename)
    except (OSError, TypeError, SyntaxError):
        return None
    if not any(_same(c, fn.__code__) for c in _code_objects(whole)):
        return None
    return hashlib.sha256(canonical(without_docstrings(tree)).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def _compile(text, filename):
    return compile(text, filename, "exec", dont_inherit=True)


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _same(a, b):
    """Whether two code objects are the same code at the same place (their bytecode, names and constants)."""
    if (a.co_name, a.co_firstlineno, a.co_code, a.co_names, a.co_varnames, a.co_freevars, len(a.co_consts)) != \
            (b.co_name, b.co_firstlineno, b.co_code, b.co_names, b.co_varnames, b.co_freevars, len(b.co_consts)):
        return False
    return all(_same(x, y) if isinstance(x, types.CodeType) else (type(x), repr(x)) == (type(y), repr(y))
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
def global_names(code):
    """The names a code object (and the functions and lambdas inside it) reads as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return frozenset(names)


def parts(cls, methods):
    """The live objects that define what cls computes, by name: the methods named on cls and its bases below
    nn.Module ('Class.name', and 'Class.name.__code__' for their code), the classes' other attributes that
    are not functions, and the globals those methods read (by their name; a builtin where the file has
    none), followed into functions of the methods' own file."""
    out = {}
    for name, holder, key, value in _reads(cls, methods):
        if value is not MISSING:
            out[name] = value
        elif isinstance(holder, dict) and hasattr(builtins, key):  # a global the file does not define
            out[name] = getattr(builtins, key)
    return out


def _reads(cls, methods):
    """(name, holder, key, value) for each object parts() reads: value = holder's under key (a mapping's
    item, or a function's __code__), MISSING where a class or a file has none."""
    classes = cls.__mro__[:cls.__mro__.index(nn.Module)]
    names = sorted(set(methods) | {n for k in classes for n, v in vars(k).items()
                                   if not (n.startswith("__") or callable(v) or isinstance(v, property))})
    out, todo, done = [], [], set()
    for klass in classes:
        attributes = klass.__dict__  # one view for all its names
        for name in names:
            value = attributes.get(name, MISSING)
            if value is not MISSING or name in methods:
                out.append((f"{klass.__qualname__}.{name}", attributes, name, value))
            todo += [value] if isinstance(value, types.FunctionType) else []
    while todo:
        fn = todo.pop()
        out.append((f"{fn.__qualname__}.__code__", fn, "__code__", fn.__code__))
        for name in sorted(global_names(fn.__code__)):
            value = fn.__globals__.get(name, MISSING)
            out.append((name, fn.__globals__, name, value))
            if name not in done and isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                todo.append(value)
            done.add(name)
    return out


def definition(cls, methods):
    """parts(cls, methods) fingerprinted: a function of the definition by tree_hash, a module, class or
    function of a library (or a builtin) by its name, any other value by its repr."""
    live = parts(cls, methods)
    out = {}
    for name, value in live.items():
        if isinstance(value, types.CodeType):
            continue  # the function's own entry reads its source through its __code__
        if isinstance(value, types.FunctionType) and f"{value.__qualname__}.__code__" in live:
            out[name] = tree_hash(value)
        elif isinstance(value, types.ModuleType):
            out[name] = f"module {value.__name__}"
        elif isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):  # a library's, a builtin
            out[name] = f"{type(value).__name__} {value.__qualname__}"  # (where it lives varies by version)
        else:
            out[name] = repr(value)
    return out


def structure(module):
    """Per submodule: its name, type, public settings (an instance's own attributes, methods replaced on it
    among them), its parameters' shapes and whether it has hooks that can change its output or gradients;
    then whether PyTorch has such hooks for every module."""
    out = []
    for name, m in module.named_modules():
        settings = tuple((k, _hashable(v)) for k, v in vars(m).items() if k[0] != "_" and k != "training")
        params = tuple((k, None if p is None else tuple(p.shape)) for k, p in m._parameters.items())
        hooks = bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        out.append((name, type(m), settings, params, hooks))
    g = nn.modules.module
    return tuple(out), bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks)


def watch(module, methods):
    """All that definition(type(module), methods) and structure(module) read, for unchanged(): the objects
    that mappings hold (or MISSING), the mappings' sizes (so that an added key shows) and functions' code."""
    held, sizes, codes = [], [], []
    for _, holder, key, value in _reads(type(module), methods):
        if isinstance(holder, types.FunctionType):
            codes.append((holder, value))
        else:
            held.append((holder, key, value))
            sizes.append((holder, len(holder)))
    for m in module.modules():
        held += [(vars(m), k, v) for k, v in vars(m).items() if k[0] != "_" and k != "training"]
        held += [(d, k, v) for d in (m._modules, m._parameters) for k, v in d.items()]
        sizes += [(d, len(d)) for d in (vars(m), m._modules, m._parameters, m._forward_hooks, m._forward_pre_hooks,
                                        m._backward_hooks, m._backward_pre_hooks)]
    g = nn.modules.module
    sizes += [(d, len(d)) for d in (g._global_forward_hooks, g._global_forward_pre_hooks, g._global_backward_hooks)]
    return held, list({id(d): (d, n) for d, n in sizes}.values()), codes


def unchanged(watched):
    """Whether all that watch() saw is as it was, by identity: microseconds."""
    held, sizes, codes = watched
    for d, k, v in held:
        if d.get(k, MISSING) is not v:
            return False
    for d, n in sizes:
        if len(d) != n:
            return False
    for fn, code in codes:
        if fn.__code__ is not code:
            return False
    return True


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)
