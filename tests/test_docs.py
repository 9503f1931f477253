"""The docs hold together: README.md short, every page under docs/ reachable from it and under its
length limit, every link between pages (and its #anchor) resolving, every script a page runs with
`bash` run by a test, the configuration reference equal to what `meshtrain/config.py` generates, and no
docstring in meshtrain/ carrying a measured figure (those belong in docs/, each with its command).
(Every `python -m meshtrain...` command of the pages runs in tests/test_readme_commands.py.)"""

from __future__ import annotations

import ast
import re

import pytest

from meshtrain import config as config_lib, config_reference
from tests import package_layout
from tests.utils import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
ALL = [README, CONTRIBUTING, *PAGES]
README_LINES, PAGE_LINES = 200, 400
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A number (not inside an identifier such as H100s) and a unit of memory, time, speed or share; a bare `s`
# only after a space or hyphen, so that "runs of 0s" or "CRC-32s" is no duration. Code in backticks is skipped.
FIGURE = re.compile(r"(?<![\w.])\d[\d,.]*(?:e[+-]?\d+)?"
                    r"(?:(?:\s+|-)?(?:GiB|MiB|GB|MB|ms|TFLOP/s)\b|(?:\s+|-)(?:s|seconds?)\b|\s?%)")
CODE = re.compile(r"(`+).*?\1", re.S)
# Docstrings whose figures are settings, not measurements: {(path, qualified name): why the figure stays}
FIGURES_ALLOWED = {
    ("meshtrain/checksums.py", "crc32"): "the read size it uses (1 << 22 bytes)",
    ("meshtrain/launch.py", "<module>"): "jax.distributed's default heartbeat timeout, a JAX setting",
    ("meshtrain/run_guards.py", "Watchdog"): "gloo's collective timeout on CPU, a gloo setting",
    ("meshtrain/plan/goodput.py", "<module>"): "the default host link's bandwidth (PCIe Gen5 x16), an input",
    ("meshtrain/plan/memory.py", "<module>"): "the playbook's own arithmetic, checked by tests/test_plan.py",
}


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)}


def _links(path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+://", m.group(1))]


def test_readme_and_pages_are_short():
    assert len(README.read_text().splitlines()) <= README_LINES
    long = {p.name: n for p in PAGES if (n := len(p.read_text().splitlines())) > PAGE_LINES}
    assert not long, f"pages over {PAGE_LINES} lines: {long}"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(path):
    for link in _links(path):
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        assert resolved.exists(), f"{path.name}: link {link!r}: no {resolved}"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{path.name}: link {link!r}: no heading #{anchor} in {resolved.name}"


def test_every_page_is_reachable_from_the_readme():
    seen, todo = set(), [README.resolve()]
    while todo:
        path = todo.pop()
        if path in seen or path.suffix != ".md" or not path.exists():
            continue
        seen.add(path)
        todo += [(path.parent / link.partition("#")[0]).resolve() for link in _links(path) if link.partition("#")[0]]
    missing = [p.name for p in [*PAGES, CONTRIBUTING] if p.resolve() not in seen]
    assert not missing, f"not reachable from README.md: {missing}"


def test_every_bash_script_the_docs_run_is_run_by_a_test():
    scripts = set()
    for path in [README, *PAGES]:
        for block in re.finditer(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            scripts |= set(re.findall(r"(?m)^(?:\w+=\S+ )*bash (\S+)", block.group(1)))
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    unrun = [s for s in sorted(scripts) if f'"bash", "{s}"' not in tests]
    assert scripts and not unrun, f"scripts the docs run that no test runs: {unrun}"


def test_configuration_reference_is_generated_from_config_py():
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = page.split(config_reference.BEGIN, 1)[1].split(config_reference.END, 1)[0]
    assert block.strip() == config_reference.reference().strip(), (
        "docs/configuration.md is stale: python -m meshtrain.config_reference --write docs/configuration.md")
    keys = config_reference.flat_keys(config_lib.default_config())
    listed = set(re.findall(r"(?m)^\| `([\w.]+)` \|", block))
    assert listed == set(keys)


def test_reference_rules_are_the_ones_validation_states():
    """A probed rule is the run's own message: a broken value gets exactly that ConfigError."""
    assert config_reference.rule("attention.impl", "auto").startswith("must be one of ('auto'")
    assert config_reference.rule("train.b1", 0.9) == "must be in [0, 1) (an Adam moment's decay)"
    assert config_reference.rule("model.qk_norm", False) == ""  # a bool has no rule beyond its type


def _docstrings(path):
    """(line, qualified name, docstring) of the module and of every class and function in it."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if (doc := ast.get_docstring(child)) is not None:
                    yield child.body[0].lineno, name, doc
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    tree = ast.parse(path.read_text())
    if (doc := ast.get_docstring(tree)) is not None:
        yield 1, "<module>", doc
    yield from walk(tree, "")


def test_no_docstring_states_a_measured_figure():
    """A docstring says what the code does and why, and stays true when the numbers move: a timing, a
    compile's memory or an MFU goes in docs/ with its command (STYLE.md). Settings are allowed by name."""
    found, allowed_seen = [], set()
    for path in sorted((ROOT / "meshtrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, name, doc in _docstrings(path):
            if not (figures := [m.group(0) for m in FIGURE.finditer(CODE.sub("", doc))]):
                continue
            if (rel, name) in FIGURES_ALLOWED:
                allowed_seen.add((rel, name))
            else:
                found.append(f"{rel}:{line}:{name}: {figures}")
    assert not found, "measured figures in docstrings (move them to docs/):\n" + "\n".join(found)
    stale = set(FIGURES_ALLOWED) - allowed_seen
    assert not stale, f"allowed docstrings that state no figure any more: {sorted(stale)}"


def test_contributing_layout_is_generated_from_the_module_docstrings():
    """CONTRIBUTING.md's layout lists every module of meshtrain/ with its docstring's first sentence."""
    page = CONTRIBUTING.read_text()
    block = page.split(package_layout.BEGIN, 1)[1].split(package_layout.END, 1)[0]
    assert block.strip() == package_layout.layout().strip(), (
        "CONTRIBUTING.md's layout is stale: python -m tests.package_layout --write CONTRIBUTING.md")
    modules = {p.name for p in (ROOT / "meshtrain").rglob("*.py") if p.name != "__init__.py"}
    listed = set(re.findall(r"(?m)^ +(\w+\.py) ", block))
    assert listed == modules
