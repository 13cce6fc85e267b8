"""The house stays one-way: import-linter's contracts in pyproject.toml (layers, no model importing
training code, no circle in any package), imports at the top of their files except heavy optional
ones (each marked; in the package, scripts/ and tests/), and functions short enough to read."""

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxcolossal"
MAX_FUNCTION_LINES = 80


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT), ast.parse(path.read_text())


def _import_rule_files() -> list[pathlib.Path]:
    """The files under the import rule: the package, ``scripts/*.py`` and ``tests/**/*.py``."""
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").rglob("*.py")])


def test_the_import_contracts_hold():
    # In its own process: import-linter configures logging with dictConfig, which disables every logger
    # that exists in the calling process (the project's included) for the rest of the test worker.
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_imports_sit_at_the_top_except_marked_heavy_optional_ones():
    """An import inside a function (or class, or ``if`` block) carries ``# heavy: why`` or
    ``# optional: why`` on its line: a heavy or optional dependency, or one that must wait (a
    script's jax until its ``main`` has set up the devices; a script a test puts on ``sys.path``).
    The files are read with ``ast``, not imported."""
    files = _import_rule_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == {"jaxcolossal", "scripts", "tests"}
    late = []
    for path in files:
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text, filename=str(path))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                line = lines[node.lineno - 1]
                if not any(w in line for w in ("# heavy", "# optional")):
                    late.append(f"{path.relative_to(ROOT)}:{node.lineno}: {line.strip()}")
    assert not late, "function-local imports without a '# heavy' or '# optional' mark:\n" + "\n".join(late)


def test_every_function_is_short_enough_to_read():
    long = [(node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}")
            for path, tree in _trees() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {sorted(long, reverse=True)}"


def _chain(text: str) -> list[str]:
    """The layer names of the first diagram line that starts with ``errors ──>``."""
    line = next(ln for ln in text.splitlines() if ln.startswith("errors ──>"))
    return [w.strip() for w in line.split("──>")]


def test_readme_and_design_chains_equal_the_layers_contract():
    block = re.search(r'type = "layers"\nlayers = \[(.*?)\]', (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    layers = re.findall(r'"([^"]+)"', block)  # the first contract's layers, top first
    bottom_up = [layer.split("|")[0].strip().removeprefix("jaxcolossal.") for layer in reversed(layers)]
    assert _chain((ROOT / "README.md").read_text()) == bottom_up
    assert _chain((ROOT / "docs" / "design.md").read_text()) == bottom_up


def test_at_most_six_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 6, loose
