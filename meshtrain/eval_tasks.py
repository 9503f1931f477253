"""lm-eval tasks: finding them, running them on a model, reading their results, and the config rule
of the in-loop evaluation (`config.eval_tasks`).

lm-eval is an optional dependency (`pip install 'meshtrain[eval]'`, included in the test extra):
every function here imports it when called and turns its absence into one `ConfigError`. The
model these tasks run on is `evaluate.MeshtrainLM`; this module does not need it, so the config
rules (`validate.py`) can use it without importing the model's loading path.
"""

from __future__ import annotations

import functools

import ml_collections

from meshtrain import config as config_lib


def require_lm_eval() -> None:
    """Raises ConfigError (naming the extra to install) when lm-eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise config_lib.ConfigError("tasks", "lm-eval", "evaluation needs the lm-eval package: pip install "
                                     "'meshtrain[eval]' (the test extra includes it)") from error


def task_list(text: str) -> list[str]:
    """Task names from a comma-separated string ("a, b" -> ["a", "b"])."""
    return [t.strip() for t in str(text).split(",") if t.strip()]


@functools.cache
def task_manager(include_path: str = ""):
    """lm-eval's `TaskManager` over its own tasks and the task YAMLs under `include_path`: built once
    per folder and process (it indexes every task file lm-eval ships, which takes seconds:
    docs/evaluation.md), so the evaluation at every `eval_every` and the config check before it share one."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path or None)


def check_known(key: str, tasks: list[str], manager, include_key: str = "") -> None:
    """Raises ConfigError under `key` when lm-eval knows some of `tasks` by no name; `include_key`
    names the option that adds task YAMLs of one's own (suggested when it is unset)."""
    unknown = [t for t in tasks if t not in manager.all_tasks]
    hint = f" (task YAMLs of your own: {include_key}=DIR)" if include_key else ""
    config_lib.require(not unknown, key, ",".join(tasks), f"lm-eval knows no task {unknown}{hint}")


def run_tasks(lm, tasks: list[str], *, include_path: str = "", limit: int | float | None = None,
              num_fewshot: int | None = None, log_samples: bool = False) -> dict:
    """lm-eval's results for `tasks` (names, or YAML tasks under `include_path`) with `lm`."""
    manager = task_manager(include_path)
    check_known("tasks", tasks, manager, "" if include_path else "--include_path")
    import lm_eval

    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples, torch_random_seed=None,
                                   bootstrap_iters=0)


def summary(results: dict) -> dict[str, float]:
    """{"task/metric": value} of lm-eval's results (standard errors left out)."""
    out = {}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and "stderr" not in name and name not in ("alias", "sample_len"):
                out[f"{task}/{name.split(',')[0]}"] = float(value)
    return out


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """The in-loop evaluation rules (gathered by `meshtrain.validate`). Raises ConfigError."""
    tasks = task_list(config.eval_tasks)
    if not tasks:
        return
    config_lib.require(config.eval_every > 0, "eval_tasks", config.eval_tasks,
                       "runs at each evaluation: set eval_every > 0 too")
    for axis in ("stage", "sequence"):
        config_lib.require(sizes[axis] == 1, "eval_tasks", config.eval_tasks,
                           f"lm-eval tasks run every layer on whole sequences: mesh.{axis} must be 1")
    include = config.eval_tasks_include_path
    check_known("eval_tasks", tasks, task_manager(include), "" if include else "eval_tasks_include_path")
