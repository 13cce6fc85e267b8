"""Every ``jaxcolossal.x.y`` the documentation names exists: a module, or an object in one.

The references come from the docstrings (module, class and function docstrings, and the bare
strings that document an attribute) of ``jaxcolossal/**/*.py`` and ``scripts/*.py``, and from
``docs/*.md`` and ``README.md``: Sphinx roles (``:func:`~jaxcolossal.x.y```, ``:mod:``,
``:class:``, ...), backticked names and bare dotted names alike. Each resolves as Python would:
the longest prefix that imports as a module, then ``getattr`` for the rest. A module or function
moved or renamed without its references makes this test list each stale one with its file and
line. Nothing is computed: only imports, which start no JAX backend.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a dotted name that starts with ``jaxcolossal.``; not part of a longer name, a path or a file name
# (``/tmp/jaxcolossal.x``, ``my.jaxcolossal.x``); ``jaxcolossal-run-...`` and the logger name
# ``jaxcolossal`` alone have no dot after the package name, so they are not references
REFERENCE = re.compile(r"(?<![\w./\-])jaxcolossal(?:\.[A-Za-z_]\w*)+")


def references_in(text, first_line=1):
    """``(line, reference)`` for each reference in ``text``, whose first line is ``first_line``.

    A trailing ``.py`` (``jaxcolossal.run.py``) or a following ``/`` or ``-`` (a path, a file
    prefix) is a file name, not a Python reference, and is left out.
    """
    out = []
    for m in REFERENCE.finditer(text):
        ref = m.group(0)
        after = text[m.end():m.end() + 1]
        if ref.endswith(".py") or after in ("/", "-"):
            continue
        out.append((first_line + text.count("\n", 0, m.start()), ref))
    return out


def docstring_references(path):
    """References in the docstrings of one Python file: every bare string statement (module,
    class and function docstrings, and the strings placed after an attribute to document it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.extend(references_in(node.value.value, node.value.lineno))
    return out


def sources():
    """``(path, [(line, reference), ...])`` for every file whose text is checked."""
    for path in sorted((ROOT / "jaxcolossal").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        yield path, docstring_references(path)
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        yield path, references_in(path.read_text(encoding="utf-8"))


def _instance_attributes(cls):
    """The names a class's methods assign on ``self`` (``self.x = ...``, ``self.x: T = ...``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _has_attribute(obj, name):
    """``getattr``, or on a class an attribute its instances have and the class does not: a
    dataclass field or annotated attribute with no default, or one set in a method (``self.x = ...``)."""
    if hasattr(obj, name):
        return True
    if isinstance(obj, type):
        return any(name in getattr(k, "__dataclass_fields__", {}) or name in vars(k).get("__annotations__", {})
                   or name in _instance_attributes(k) for k in obj.__mro__ if k is not object)
    return False


_CACHE = {}


def resolve(ref):
    """``None`` when ``ref`` names a module or an object in one; else why it does not."""
    if ref not in _CACHE:
        _CACHE[ref] = _resolve(ref)
    return _CACHE[ref]


def _resolve(ref):
    parts = ref.split(".")
    if "__main__" in parts:  # importing it would run the command: that the file exists is enough
        i = parts.index("__main__") + 1
        if i != len(parts):
            return "names an attribute of a __main__ module"
        return None if importlib.util.find_spec(ref) is not None else "no such module"
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            return f"importing {name} fails: {e!r}"
        except Exception as e:  # noqa: BLE001  (a module that exists but does not import)
            return f"importing {name} fails: {e!r}"
        for k in range(i, len(parts)):
            if not _has_attribute(obj, parts[k]):
                return f"{'.'.join(parts[:k])} has no attribute {parts[k]!r}"
            obj = getattr(obj, parts[k], None)
        return None
    return "no importable prefix"


def unresolved(found):
    """``file:line: reference (why)`` for each reference of ``found`` (as :func:`sources` yields)
    that does not resolve."""
    out = []
    for path, refs in found:
        for line, ref in refs:
            why = resolve(ref)
            if why is not None:
                out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {ref} ({why})")
    return out


def test_every_reference_resolves():
    found = list(sources())
    n = sum(len(refs) for _, refs in found)
    assert n > 300, f"only {n} references found: is the collector broken?"
    stale = unresolved(found)
    print(f"{n} references ({len({r for _, refs in found for _, r in refs})} distinct), {len(stale)} unresolved")
    for s in stale:
        print(s)
    assert not stale, "stale references (point each to where the thing lives now):\n" + "\n".join(stale)


def test_a_renamed_reference_is_caught():
    assert resolve("jaxcolossal.parallel.sharding.state_specs") is None
    assert resolve("jaxcolossal.parallel.sharding") is None
    assert resolve("jaxcolossal.parallel.sharding.Sharder.collective_matmul") is None
    assert resolve("jaxcolossal.parallel.sharding.Sharder.manual_experts") is None  # set in __init__
    assert resolve("jaxcolossal.parallel.sharding.Sharder.no_such_attribute") is not None
    assert resolve("jaxcolossal.run") is None  # the launcher's command module
    assert resolve("jaxcolossal.plan.__main__") is None  # found, not run
    assert "no attribute 'no_such_function'" in resolve("jaxcolossal.parallel.sharding.no_such_function")
    assert resolve("jaxcolossal.no_such_module.state_specs") is not None
    assert resolve("jaxcolossal.sharding.state_specs") is not None  # the module before it moved
    assert resolve("jaxcolossal.activations.step_peak") is not None


def test_the_collector_reads_roles_backticks_and_bare_names_and_skips_files():
    text = (":func:`~jaxcolossal.parallel.sharding.no_such_function` and\n"
            ":mod:`jaxcolossal.parallel.mesh`, ``jaxcolossal.memory.budget.need(cfg)``, `jaxcolossal.aot`\n"
            "see jaxcolossal.train.step. Not: jaxcolossal/run.py, jaxcolossal.run.py, jaxcolossal-run-3,\n"
            "the logger jaxcolossal, /tmp/jaxcolossal.x, jaxcolossal.x/y\n")
    assert references_in(text, 10) == [
        (10, "jaxcolossal.parallel.sharding.no_such_function"), (11, "jaxcolossal.parallel.mesh"),
        (11, "jaxcolossal.memory.budget.need"), (11, "jaxcolossal.aot"), (12, "jaxcolossal.train.step")]


def test_a_stale_docstring_is_reported_with_its_file_and_line(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text('"""Module.\n\nUses :func:`jaxcolossal.parallel.sharding.state_specs`."""\n\n\n'
                    'def f():\n    """Calls\n    :func:`~jaxcolossal.parallel.sharding.no_such_function`."""\n')
    stale = unresolved([(path, docstring_references(path))])
    assert len(stale) == 1 and stale[0].startswith(f"{path}:8: jaxcolossal.parallel.sharding.no_such_function ("), stale
