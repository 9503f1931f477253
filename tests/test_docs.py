"""The docs hold together: README.md short, every page under docs/ reachable from it and under its
length limit, every link between pages (and its #anchor) resolving, every script a page runs with
`bash` run by a test, and the configuration reference equal to what `meshtrain/config.py` generates.
(Every `python -m meshtrain...` command of the pages runs in tests/test_readme_commands.py.)"""

from __future__ import annotations

import re

import pytest

from meshtrain import config as config_lib, config_reference
from tests.utils import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
ALL = [README, CONTRIBUTING, *PAGES]
README_LINES, PAGE_LINES = 200, 400
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


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
