"""No pickle, no eval, no torch.load without weights_only=True anywhere in the package.

    python -m pytest -q tests/test_no_unsafe_calls.py

The source is read with `ast`, not grepped, so comments, strings and methods that share
a name (`model.eval()`, `checkpoint.load(...)`) are not mistaken for the real thing. The
checker is itself tested on small sources that hold each forbidden pattern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "myelin"

# Modules whose loading runs arbitrary code from the bytes it reads.
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}
UNSAFE_BUILTINS = {"eval", "exec"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
USUAL_ALIASES = {"np": "numpy"}  # resolved even where the import is out of sight


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a Name or a chain of Attributes on one; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def imported_names(tree: ast.AST) -> dict[str, str]:
    """What each imported name stands for: `import numpy as np` gives np -> numpy."""
    names = dict(USUAL_ALIASES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def resolve(node: ast.expr, names: dict[str, str]) -> str | None:
    """The full dotted name a call target stands for, through the file's imports."""
    name = dotted(node)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    full = names.get(head, head)
    return f"{full}.{rest}" if rest else full


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def is_false(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def unsafe_module(name: str) -> bool:
    return name.split(".")[0] in UNSAFE_MODULES


def check_call(call: ast.Call, names: dict[str, str]) -> str | None:
    """Why this call is unsafe, or None."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in UNSAFE_BUILTINS:
        return f"builtin {func.id}()"
    target = resolve(func, names)
    if target is None:
        return None
    short = target.split(".")[-1]
    splat = any(k.arg is None for k in call.keywords)  # **kwargs: cannot tell what it holds
    if target in {"builtins.eval", "builtins.exec"}:
        return f"{target}()"
    if unsafe_module(target) and "." in target:
        return f"{target}()"
    if target in {"__import__", "importlib.import_module"} and call.args:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if unsafe_module(arg.value):
                return f"{target}({arg.value!r})"
    if target in {"torch.load", "torch.serialization.load"}:
        if not is_true(keyword(call, "weights_only")):
            return f"{target}() without weights_only=True"
    if target in {"numpy.load", "numpy.lib.npyio.load"}:
        allow = keyword(call, "allow_pickle")
        if splat or (allow is not None and not is_false(allow)):
            return f"{target}() with allow_pickle"
    if target.startswith("yaml.") and short in {"unsafe_load", "unsafe_load_all", "full_load"}:
        return f"{target}()"
    if target in {"yaml.load", "yaml.load_all"}:
        loader = keyword(call, "Loader")
        if loader is None and len(call.args) > 1:
            loader = call.args[1]
        loader_name = dotted(loader) if loader is not None else None
        if loader_name is None or loader_name.split(".")[-1] not in SAFE_YAML_LOADERS:
            return f"{target}() without yaml.SafeLoader"
    return None


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every unsafe import or call in `source`, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    names = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        why = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if unsafe_module(a.name)]
            why = f"import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.ImportFrom) and node.module and unsafe_module(node.module):
            why = f"from {node.module} import ..."
        elif isinstance(node, ast.Call):
            why = check_call(node, names)
        if why:
            found.append(f"{filename}:{node.lineno}: {why}")
    return sorted(found, key=lambda s: int(s.split(":")[1]))


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_no_unsafe_calls():
    files = package_files()
    assert len(files) > 10, f"found only {files} under {PACKAGE}"
    found = []
    for path in files:
        rel = path.relative_to(PACKAGE.parent)
        found += unsafe_uses(path.read_text(encoding="utf-8"), str(rel))
    assert not found, "unsafe deserialisation or eval in the package:\n" + "\n".join(found)


# -- the checker catches each pattern --------------------------------------------------

FORBIDDEN = [
    ("import pickle", "import pickle"),
    ("import cPickle", "import cPickle"),
    ("import _pickle", "import _pickle"),
    ("import dill", "import dill"),
    ("import dill.source", "import dill.source"),
    ("import marshal", "import marshal"),
    ("import shelve", "import shelve"),
    ("import os, pickle as p", "import pickle"),
    ("from pickle import loads", "from pickle import"),
    ("from marshal import loads as l", "from marshal import"),
    ("pickle.load(f)", "pickle.load()"),
    ("pickle.loads(b)", "pickle.loads()"),
    ("import pickle as p\np.loads(b)", "pickle.loads()"),
    ("pickle.Unpickler(f).load()", "pickle.Unpickler()"),
    ("__import__('pickle')", "__import__('pickle')"),
    ("import importlib\nimportlib.import_module('dill')", "import_module('dill')"),
    ("eval('1 + 1')", "builtin eval()"),
    ("exec('x = 1')", "builtin exec()"),
    ("def f(s):\n    return eval(s)", "builtin eval()"),
    ("import builtins\nbuiltins.eval('1')", "builtins.eval()"),
    ("import torch\ntorch.load(f)", "without weights_only=True"),
    ("import torch\ntorch.load(f, weights_only=False)", "without weights_only=True"),
    ("import torch\ntorch.load(f, weights_only=safe)", "without weights_only=True"),
    ("import torch\ntorch.load(f, **kwargs)", "without weights_only=True"),
    ("import torch\ntorch.load(f, map_location='cpu')", "without weights_only=True"),
    ("import torch as T\nT.load(f)", "torch.load() without"),
    ("from torch import load\nload(f)", "torch.load() without"),
    ("from torch import load as tl\ntl(f)", "torch.load() without"),
    ("import torch\ntorch.serialization.load(f)", "torch.serialization.load() without"),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", "numpy.load() with allow_pickle"),
    ("import numpy\nnumpy.load(f, allow_pickle=True)", "numpy.load() with allow_pickle"),
    ("np.load(f, allow_pickle=flag)", "numpy.load() with allow_pickle"),
    ("import yaml\nyaml.load(s)", "yaml.load() without yaml.SafeLoader"),
    ("import yaml\nyaml.load(s, Loader=yaml.Loader)", "without yaml.SafeLoader"),
    ("import yaml\nyaml.load(s, yaml.FullLoader)", "without yaml.SafeLoader"),
    ("import yaml\nyaml.load_all(s)", "yaml.load_all() without"),
    ("import yaml\nyaml.unsafe_load(s)", "yaml.unsafe_load()"),
    ("import yaml\nyaml.full_load(s)", "yaml.full_load()"),
]

ALLOWED = [
    "model.eval()",
    "self.module.eval()",
    "x = model.eval().train()",
    "obj.exec()",
    "s = 'eval(1) and pickle.loads(b)'",
    "# import pickle; eval(s); torch.load(f)\nx = 1",
    '"""torch.load(f) and import pickle in a docstring"""',
    "import torch\ntorch.load(f, weights_only=True)",
    "import torch\ntorch.load(f, map_location='cpu', weights_only=True)",
    "from torch import load\nload(f, weights_only=True)",
    "import torch\ntorch.save(state, f)",
    "from myelin import checkpoint\ncheckpoint.load(trainer, path)",
    "def load(path):\n    return path\nload('x')",
    "import numpy as np\nnp.load(f)",
    "import numpy as np\nnp.load(f, allow_pickle=False)",
    "import yaml\nyaml.safe_load(s)",
    "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.load(s, yaml.CSafeLoader)",
    "import json, msgpack\njson.loads(s)\nmsgpack.unpackb(b)",
    "import pickletools",
    "def f(evaluate):\n    return evaluate(1)",
    "trainer.evaluate(loader)",
]


@pytest.mark.parametrize("source, why", FORBIDDEN, ids=[s for s, _ in FORBIDDEN])
def test_the_checker_flags(source, why):
    found = unsafe_uses(source, "snippet.py")
    assert found, f"not flagged: {source!r}"
    assert any(why in f for f in found), f"{found} do not say {why!r}"
    assert all(f.startswith("snippet.py:") for f in found)


@pytest.mark.parametrize("source", ALLOWED)
def test_the_checker_allows(source):
    assert unsafe_uses(source, "snippet.py") == []


def test_the_checker_names_file_and_line():
    source = "import torch\n\n\ndef restore(f):\n    return torch.load(f)\n"
    assert unsafe_uses(source, "myelin/x.py") == [
        "myelin/x.py:5: torch.load() without weights_only=True"
    ]
