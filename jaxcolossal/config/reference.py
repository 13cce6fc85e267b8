"""The configuration reference, read from the schema: every key's doc is the attribute docstring on
the lines right after its field in :mod:`jaxcolossal.config.schema` (the string statement that
follows ``zero_stage: int = 0``), so a key's documentation lives beside the key.

:func:`field_docs` returns ``{dotted key: doc}``; :func:`config_reference_markdown` renders
docs/config.md (``scripts/config_reference.py`` writes it); :func:`config_help` is the key list of
``scripts/train.py --help``. Everything here is a pure function of the schema's source.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Literal

from jaxcolossal.config import schema
from jaxcolossal.config.load import all_keys
from jaxcolossal.config.schema import AutoFloat, Bytes, Config, StepRange, yaml_list

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")

INTRO = """# Configuration reference

A run's configuration is a YAML file with the sections below (`--config configs/llama_tiny.yaml`,
the default) plus `section.key=value` overrides on the command line, which win over the file:

```bash
python scripts/train.py parallel.zero_stage=3 training.max_steps=50
python scripts/train.py --config configs/llama_tiny_3d.yaml precision.bf16=true
```

An override's value is read as YAML (`3` is an integer, `true` a boolean, `1e-4` a number where the
key is one). Unknown keys, wrong types, values out of range and impossible combinations are refused
before anything compiles, naming the key. A misspelt key, or another framework's name for one, gets a
"did you mean" hint: `jaxcolossal.config.ALIASES` maps such names (`tp`, `zero`, `lr`, ...) to the
keys here; they are hints, not keys. `python scripts/train.py --help` lists every key too. How the
config shapes a run: [training.md](training.md).

This page is generated from the attribute docstrings in `jaxcolossal/config/schema.py` by
`python scripts/config_reference.py`; edit those, not this file.
"""
"""The page's introduction, above the generated tables."""


def _docstrings(source: str) -> dict[str, dict[str, str | None]]:
    """``{class name: {field name: its attribute docstring or None}}`` for every class of ``source``;
    a field is an annotated assignment, its docstring the string statement right after it."""
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = {}
        for stmt, nxt in zip(node.body, node.body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                is_doc = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str))
                docs[stmt.target.id] = " ".join(nxt.value.value.split()) if is_doc else None
        out[node.name] = docs
    return out


def _fields(cls: type = Config, prefix: str = ""):
    """``(dotted key, dataclass, field, type hint)`` for every field under ``cls``, sections and
    nested dataclasses included, in declaration order (the order of :func:`all_keys`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        yield key, cls, f, hints[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], key)


def _all_docs(source: str | None = None) -> dict[str, str]:
    """``{dotted key: doc}`` for every field, the sections (``model``) and ``model.lora`` included,
    from ``source`` (default: :mod:`jaxcolossal.config.schema`'s own).

    Raises:
        ValueError: a field without an attribute docstring (or an empty one), naming it.
    """
    docs = _docstrings(inspect.getsource(schema) if source is None else source)
    out, missing = {}, []
    for key, cls, f, _ in _fields():
        doc = docs.get(cls.__name__, {}).get(f.name)
        if not doc:
            missing.append(f"{key} ({cls.__name__}.{f.name})")
        out[key] = doc
    if missing:
        raise ValueError("config fields without an attribute docstring (a string literal on the line after "
                         "the field in jaxcolossal/config/schema.py): " + ", ".join(missing))
    return out


def field_docs(source: str | None = None) -> dict[str, str]:
    """``{dotted key: doc}`` for every leaf key of the config, in :func:`all_keys` order
    (``{"model.type": "The model family: ...", ...}``, 115 keys). Each doc is the field's attribute
    docstring in :mod:`jaxcolossal.config.schema`, its whitespace collapsed to single spaces (the
    reStructuredText markup kept). ``source``: the schema module's text to read the docstrings from
    (default: the module's own, ``inspect.getsource``); the fields themselves are always the
    imported dataclasses'.

    Raises:
        ValueError: a field of a config dataclass has no (or an empty) attribute docstring.
    """
    docs = _all_docs(source)
    return {key: docs[key] for key in all_keys()}


def plain(doc: str) -> str:
    """``doc`` with reStructuredText markup as Markdown code spans: ``:func:`~a.b``` and ````x````
    become `` `a.b` `` and `` `x` ``."""
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"``\1``", doc))


def first_sentence(doc: str) -> str:
    """The first sentence of ``doc``: up to the first period that whitespace and then anything but a
    lower-case letter follow (all of ``doc`` when there is none)."""
    m = re.search(r"\.\s+(?=[^a-z])", doc)
    return doc[: m.start() + 1] if m else doc


def type_name(hint) -> str:
    """A key's type as a user writes the value: ``int``, ``float``, ``bool``, ``str``, ``bytes``
    (a :class:`~jaxcolossal.config.schema.Bytes` count), ``steps`` (a
    :class:`~jaxcolossal.config.schema.StepRange`), or the allowed values of a ``Literal`` as
    Markdown code spans (```llama`, `gpt2```)."""
    if typing.get_origin(hint) is Literal:
        return ", ".join(f"`{yaml_list([v])[1:-1]}`" for v in typing.get_args(hint))
    if hint is AutoFloat:
        return "float or `auto`"
    if hint is Bytes:
        return "bytes"
    if hint is StepRange:
        return "steps"
    return getattr(hint, "__name__", str(hint))


def default_text(value) -> str:
    """A default as YAML writes it: ``false``, ``""``, ``1e-05``, ``q,v``."""
    if isinstance(value, str):
        return value if value else '""'
    return yaml_list([value])[1:-1]


def _leaves():
    """``(dotted key, field, hint, default)`` of every leaf key, in :func:`all_keys` order."""
    defaults = Config()
    for key, _, f, hint in _fields():
        if not dataclasses.is_dataclass(hint):
            obj = defaults
            for part in key.split("."):
                obj = getattr(obj, part)
            yield key, f, hint, obj


def _cell(text: str) -> str:
    """``text`` for a Markdown table cell: ``|`` escaped."""
    return text.replace("|", "\\|")


def config_reference_markdown() -> str:
    """docs/config.md: :data:`INTRO`, then one section per config section, each a table of its keys
    (key, type, default, description) in :func:`all_keys` order.

    Raises:
        ValueError: a field without an attribute docstring (:func:`field_docs`).
    """
    docs = _all_docs()
    lines = [INTRO.rstrip("\n")]
    section = None
    for key, _, hint, default in _leaves():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines += ["", f"## `{top}`", "", plain(docs[top]), "",
                      "| key | type | default | description |", "|---|---|---|---|"]
        lines.append(f"| `{key}` | {_cell(type_name(hint))} | `{_cell(default_text(default))}` | "
                     f"{_cell(plain(docs[key]))} |")
    return "\n".join(lines) + "\n"


def config_help(width: int = 100) -> str:
    """The config keys for ``scripts/train.py --help``: per section, one entry per key,
    ``section.key = default  first sentence of its doc``, wrapped to ``width`` columns.

    Raises:
        ValueError: a field without an attribute docstring (:func:`field_docs`).
    """
    docs = _all_docs()
    out, section = ["config keys (section.key=value overrides; docs/config.md has the whole reference):"], None
    for key, _, _, default in _leaves():
        top = key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"{top}: {plain(docs[top])}"]
        entry = f"{key} = {default_text(default)}  {plain(first_sentence(docs[key]))}"
        out.append(textwrap.fill(entry, width, initial_indent="  ", subsequent_indent="      ",
                                 break_on_hyphens=False, break_long_words=False))
    return "\n".join(out)
