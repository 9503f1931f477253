"""`python -m meshtrain.report WORKDIR`: a run's summary and plots, from its metrics.jsonl.

Prints the steps reached, best and last training loss, last and best evaluation loss, the
median throughput and MFU (the playbook's "Benchmarking thousands of configurations" reads
runs by the same figures), the peak memory, and the goodput over every process lifetime of the
workdir with each badput part (`meshtrain.badput`: start-up, compile, restore, checkpoint waits,
data waits, evaluation, rollbacks, hangs and the steps restarts computed again); writes PNG plots
of loss, evaluation loss, tokens/s and learning rate against step into `<workdir>/report/`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

from meshtrain import badput, durable

PLOTS = {  # file stem -> (metrics key, y label)
    "loss": ("loss", "training loss"),
    "eval_loss": ("eval_loss", "evaluation loss"),
    "tokens_per_sec": ("tokens_per_sec", "tokens / s"),
    "learning_rate": ("learning_rate", "learning rate"),
}


def read_metrics(workdir: str) -> list[dict]:
    """The logged records in step order; a step logged again (a resumed run) keeps its last record."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"workdir={workdir!r}: no metrics.jsonl (not a meshtrain run folder?)")
    by_step: dict[int, dict] = {}
    for record in durable.read_jsonl(path):  # a torn last line (a crash's) is dropped with a warning
        if "step" in record:
            by_step[int(record["step"])] = record
    if not by_step:
        raise ValueError(f"{path}: no records")
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records with a finite number under `key` ("nan" strings are skipped)."""
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(r["step"]))
            values.append(float(value))
    return steps, values


def summarize(records: list[dict]) -> dict:
    """The summary figures (None where the run did not log them)."""
    def pick(key, fn, rows=records):
        _, values = _series(rows, key)
        return fn(values) if values else None

    steady = records[1:] or records  # the first logged step includes compilation

    return {
        "steps": int(records[-1]["step"]),
        "last_loss": pick("loss", lambda v: v[-1]),
        "best_loss": pick("loss", min),
        "last_eval_loss": pick("eval_loss", lambda v: v[-1]),
        "best_eval_loss": pick("eval_loss", min),
        "median_tokens_per_sec": pick("tokens_per_sec", statistics.median, steady),
        "median_mfu": pick("mfu", statistics.median, steady),
        "peak_memory_bytes": pick("peak_bytes_in_use", max),
    }


def format_summary(summary: dict) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    mfu, mem = summary["median_mfu"], summary["peak_memory_bytes"]
    lines = [
        f"steps                    {summary['steps']}",
        f"loss (last / best)       {num(summary['last_loss'], '.4f')} / {num(summary['best_loss'], '.4f')}",
        f"eval loss (last / best)  {num(summary['last_eval_loss'], '.4f')} / {num(summary['best_eval_loss'], '.4f')}",
        f"median tokens/s          {num(summary['median_tokens_per_sec'], ',.0f')}",
        f"median MFU               {'n/a' if mfu is None else format(mfu * 100, '.1f') + '%'}",
        f"peak memory              {'n/a' if mem is None else format(mem / 2**30, '.2f') + ' GiB'}",
    ]
    return "\n".join(lines)


def plot(records: list[dict], out_dir: str) -> list[str]:
    """One PNG per metric the run logged; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for stem, (key, label) in PLOTS.items():
        steps, values = _series(records, key)
        if not steps:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}.png")
        with durable.atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)
        written.append(path)
    return written


def report(workdir: str, out_dir: str | None = None) -> tuple[dict, list[str]]:
    """Summary figures (with "goodput": `badput.summarize`, None before runs recorded it) and the plot
    paths of the run in `workdir`."""
    records = read_metrics(workdir)
    summary = {**summarize(records), "goodput": badput.summarize(workdir)}
    return summary, plot(records, out_dir or os.path.join(workdir, "report"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtrain.report", description=__doc__.split("\n")[0])
    parser.add_argument("workdir")
    parser.add_argument("--out", help="folder for the PNGs (default: WORKDIR/report)")
    args = parser.parse_args(argv)
    try:
        summary, paths = report(args.workdir, args.out)
    except durable.WriteError as e:  # the plots' folder: a full disk, read-only
        print(f"error: {e}", file=sys.stderr)
        return 4
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if summary["goodput"]:
        print(badput.format_summary(summary["goodput"]))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
