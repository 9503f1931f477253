"""The package's shape: `config` is a leaf, the imports form no cycle (annotations' included), the
layers below the parallel plan import nothing above it, the parameter list exists once."""

from __future__ import annotations

import ast
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from meshtrain import config as config_lib, model as model_lib
from meshtrain.plan import memory
from meshtrain.sharding_rules import Rules
from tests.utils import ROOT

PACKAGE = ROOT / "meshtrain"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """meshtrain module -> the meshtrain modules it imports, at any depth of its code: inside
    functions, and under `if TYPE_CHECKING:` (an annotation's dependency is a dependency too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("meshtrain")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshtrain"):
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_config_is_a_leaf():
    code = "import sys, meshtrain.config; print(sorted(m for m in sys.modules if m.startswith('meshtrain')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "['meshtrain', 'meshtrain.config']", out.stdout


def test_package_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "meshtrain.run" in graph["meshtrain.train"]  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The commands: modules run as `python -m meshtrain.<name>`.
COMMANDS = ("meshtrain.train", "meshtrain.evaluate", "meshtrain.sample", "meshtrain.aot", "meshtrain.launch",
            "meshtrain.report", "meshtrain.lm_eval", "meshtrain.plan", "meshtrain.hf.__main__",
            "meshtrain.data.prepare")
# What the model, the data and the kernels must not reach, directly or through anything they import.
ABOVE = ("meshtrain.parallel", "meshtrain.run", "meshtrain.validate", "meshtrain.run_loop", "meshtrain.run_checkpoints",
         "meshtrain.run_guards", *COMMANDS)
BELOW = ("meshtrain.data", "meshtrain.model", "meshtrain.pallas_kernels")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_model_data_and_kernels_import_nothing_above_them():
    """`data/`, `model.py` and `pallas_kernels/` reach neither the parallel plan (`parallel/`), the run,
    the loop nor a command: the model gets its layer-stack runner and attention function passed in
    (`model.LayerStack`), the data its batch layout (`data.BatchLayout`)."""
    graph = import_graph()
    lower = [m for m in graph if _within(m, BELOW) and m != "meshtrain.data.prepare"]  # prepare is a command
    assert {"meshtrain.model", "meshtrain.data", "meshtrain.data.loader", "meshtrain.pallas_kernels"} <= set(lower)
    for module in lower:
        bad = sorted(m for m in reachable(graph, module) if _within(m, ABOVE))
        assert not bad, f"{module} imports {bad}"


def test_the_run_loop_imports_no_command():
    graph = import_graph()
    assert not [m for m in reachable(graph, "meshtrain.run_loop") if _within(m, COMMANDS)]
    assert not [m for m in reachable(graph, "meshtrain.run") if _within(m, COMMANDS + ("meshtrain.validate",))]


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


MODELS = {
    "dense": {},
    "moe_every_2": {"num_experts": 4, "moe_every": 2, "moe_mlp_dim": 24},
    "shared_expert": {"num_experts": 4, "shared_expert": True, "tie_embeddings": True},
}


@pytest.mark.parametrize("name", MODELS)
def test_planner_parameter_bytes_equal_the_initialised_model(name):
    """The planner's table and the counts come from the model's own parameters: bytes equal those of
    a real `init` (not an abstract trace) on one device, leaf by leaf."""
    cfg = config_lib.ModelConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=4,
                                 mlp_dim=32, **MODELS[name])
    mesh = jax.make_mesh((1,) * 6, config_lib.MESH_AXES, devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    ids = jnp.zeros((1, 4), jnp.int32)
    with jax.set_mesh(mesh):
        params = nn.unbox(model_lib.Transformer(cfg, Rules.for_mesh(mesh)).init(jax.random.key(0), ids, ids, ids + 1))
    real = {"/".join(str(k.key) for k in path): leaf for path, leaf in
            jax.tree_util.tree_leaves_with_path(params["params"])}
    table = {leaf.path: leaf for leaf in memory.param_table(cfg)}
    assert set(table) == set(real)
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    for path, leaf in table.items():
        assert leaf.shape == real[path].shape, path
    planner_bytes = sum(leaf.size for leaf in table.values()) * itemsize
    assert planner_bytes == sum(a.nbytes for a in real.values())
    assert model_lib.num_params(cfg) * itemsize == planner_bytes
    if cfg.num_experts:
        assert any(p.startswith("layers/moe_layer/moe/") for p in table)
        experts = sum(leaf.size for leaf in table.values() if "expert" in leaf.names)
        assert model_lib.num_active_params(cfg) == model_lib.num_params(cfg) - experts + math.prod(
            (experts, cfg.experts_per_token)) // cfg.num_experts


def test_every_benchmark_has_a_quick_mode_that_ci_runs():
    """`bench/run_quick.py` (run by `.ci/run`) finds every benchmark script, and each takes `--quick`."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import run_quick
    finally:
        sys.path.pop(0)
    names = {run_quick.name_of(p) for p in run_quick.benchmarks()}
    on_disk = {str(p.relative_to(ROOT / "bench").with_suffix("")) for p in (ROOT / "bench").rglob("*.py")
               if not p.name.startswith("_")}  # helpers (bench/gpu/_needs.py)
    assert names == on_disk - {"run_quick"} and {"core", "comm", "gpu/mfu", "aot"} <= names
    for name in names:
        assert '"--quick"' in (ROOT / "bench" / f"{name}.py").read_text(), f"bench/{name}.py has no --quick mode"
    assert "bench/run_quick.py" in (ROOT / ".ci" / "run").read_text()


# Files written in place: each one a crash cannot tear (docs/checkpoints.md, "What a crash leaves").
WRITES_IN_PLACE = {
    "meshtrain/durable.py": "the writers themselves",
    "meshtrain/crash_points.py": "the sweep's own corpus and logs, outside the run's folders",
    "meshtrain/workdir_lock.py": "the lock's holder, rewritten in place; read as 'holder unknown' when torn",
    "meshtrain/data/sources.py": "the token cache's temporary files, renamed when complete",
    "meshtrain/data/hf_source.py": "files of a temporary folder, renamed when complete",
    "meshtrain/hf/io.py": "files of a temporary folder, renamed when complete",
    "meshtrain/local_tier.py": "files of a temporary folder, fsynced, renamed when complete",
    "meshtrain/hf/formats.py": "write_safetensors, called on a temporary folder's files",
}


def test_every_file_is_written_by_rename_or_appended_through_durable():
    """An `open` for writing or a `savefig` outside `meshtrain.durable` writes a file a crash can leave
    half written; the modules above write only temporary files (or, the lock, a record read as torn)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ("write_text", "write_bytes"):
                found.append(f"{rel}:{node.lineno} {name}")
            elif name == "savefig" and not (node.args and getattr(node.args[0], "id", "") == "tmp"):
                found.append(f"{rel}:{node.lineno} savefig")
            elif name == "open" and node.args:
                modes = node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
                mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
                if any(c in mode for c in "wax+") and rel not in WRITES_IN_PLACE:
                    found.append(f"{rel}:{node.lineno} open(..., {mode!r})")
    assert found == [], found


def test_schedule_names_appear_only_in_the_registry_and_as_config_values():
    """One place defines each pipeline schedule (`parallel.schedules.REGISTRY`): outside it and the config's
    list of choices, the package and the benchmarks name a schedule only as a value of `pipeline.schedule`
    (a preset's {"pipeline.schedule": ...}), never to decide what a schedule does."""
    from meshtrain.parallel import schedules

    allowed = {PACKAGE / "parallel" / "schedules.py", PACKAGE / "config.py"}
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        if path in allowed:
            continue
        tree = ast.parse(path.read_text())
        values = {id(v) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                  for k, v in zip(node.keys, node.values, strict=True)
                  if isinstance(k, ast.Constant) and k.value == "pipeline.schedule"}
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in schedules.REGISTRY and id(node) not in values]
    assert not found, found
