"""What this Python lacks of meshtrain's requirements, read from setup.py without running it.

    python bench/gpu/_needs.py jax            # "kept <version>", "missing", or one line why not (exit 3)
    python bench/gpu/_needs.py missing        # requirements not installed, one per line
    python bench/gpu/_needs.py wheels DIR     # the wheels in DIR whose project is not installed
    python bench/gpu/_needs.py check          # exit 1 naming each requirement still missing

Used by bench/gpu/install.sh, which never replaces a JAX that is installed in setup.py's range. Needs
only the standard library (a GPU machine's Python may have no `packaging`): setup.py's markers are
`python_version` comparisons, its specifiers `==`, `>=`, `<=`, `>`, `<` on dotted release numbers.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUARDED = ("jax", "jaxlib")  # a GPU machine's own build: kept in range, never replaced, refused out of it


def _release(version):
    """'0.12.0.1' -> (0, 12, 0, 1); local and pre-release tails ('+cuda', 'rc1') end the number."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version).group(0).split("."))


def _compare(left, op, right):
    width = max(len(left), len(right))
    left, right = left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
    return {"==": left == right, ">=": left >= right, "<=": left <= right, ">": left > right,
            "<": left < right, "!=": left != right}[op]


def requirements():
    """[(name, specifier)] of setup.py's INSTALL_REQUIRES whose marker holds for this Python."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES")
    out = []
    for entry in (ast.literal_eval(element) for element in listed.elts):
        requirement, _, marker = entry.partition(";")
        if marker:
            _, op, version = marker.split()
            if not _compare(sys.version_info[:2], op, _release(version.strip("\"'"))):
                continue
        name, spec = re.match(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*(.*)", requirement).groups()
        out.append((name.split("[")[0], spec.strip()))
    return out


def satisfies(version, spec):
    """Whether a version meets every clause of a specifier such as '>=0.10.2,<=0.12.0.1'."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, bound = re.match(r"(==|>=|<=|!=|>|<)\s*(\S+)", clause).groups()
        if not _compare(_release(version), op, _release(bound)):
            return False
    return True


def installed(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _normal(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def main(argv):
    command = argv[0] if argv else ""
    reqs = requirements()
    if command == "jax":
        found = {name: installed(name) for name in GUARDED}
        if not any(found.values()):
            print("missing")
            return 0
        spec = dict(reqs)["jax"]
        for name, version in found.items():
            if version is None or not satisfies(version, spec):
                print(f"{name} {version or 'is not installed'} beside jax {found['jax']}: meshtrain supports "
                      f"jax and jaxlib {spec} on Python {sys.version_info.major}.{sys.version_info.minor} "
                      "(setup.py); it does not replace a machine's JAX: use a Python whose JAX is in range")
                return 3
        print(f"kept {found['jax']}")
        return 0
    if command == "missing":
        print("\n".join(f"{name}{spec}" for name, spec in reqs if installed(name) is None))
        return 0
    if command == "wheels":
        for wheel in sorted(pathlib.Path(argv[1]).glob("*.whl")):
            if installed(wheel.name.split("-")[0]) is None and installed(_normal(wheel.name.split("-")[0])) is None:
                print(wheel)
        return 0
    if command == "check":
        lacking = [f"{name}{spec}" for name, spec in reqs if installed(name) is None]
        if lacking:
            print("still missing: " + ", ".join(lacking), file=sys.stderr)
        return 1 if lacking else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
