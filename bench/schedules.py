"""Pipeline slot tables: ticks, bubble and held activations per schedule, and their pictures.

    python bench/schedules.py [--stages 4] [--microbatches 4,8,16] [--repeats 2] [--draw DIR]

Playbook, "Pipeline Parallelism" ("Interleaving stages", "Zero Bubble and DualPipe"). For each
schedule of `meshtrain/schedules.py` and each m: the executed table's ticks (F, B and W one unit
each; interleaved_1f1b's alternating ticks, its B the whole backward: `schedules.executed`), its
bubble (idle over busy time per stage) beside the schedule's formula, and the most micro-batch
chunks a stage holds. `--draw DIR` writes DIR/<schedule>.png: stages x ticks, forward
/ input-gradient (B) / weight-gradient (W) / idle coloured, micro-batch numbers in the cells.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshtrain.parallel import schedules  # noqa: E402

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", None: "#eeeeee"}


def draw(table, title: str, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ticks, p = len(table), len(table[0])
    fig, ax = plt.subplots(figsize=(max(6.0, ticks * 0.32), 0.5 * p + 1.4))
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            kind = op.kind if op is not None else None
            shade = 0.55 if op is not None and op.chunk % 2 else 1.0
            ax.add_patch(plt.Rectangle((t, p - 1 - s), 1, 1, facecolor=COLOURS[kind], alpha=shade,
                                       edgecolor="white", linewidth=0.8))
            if op is not None:
                ax.text(t + 0.5, p - 0.5 - s, str(op.micro), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 0.5 - s for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_xlabel("tick (F, B, W one unit each)")
    ax.set_title(title.replace(", in flight", "\nin flight"), fontsize=8)
    ax.legend(handles=[Patch(color=COLOURS[k], label=label) for k, label in
                       (("F", "forward"), ("B", "input gradient"), ("W", "weight gradient"), (None, "idle"))],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--repeats", type=int, default=2, help="model chunks per stage (interleaved_1f1b)")
    parser.add_argument("--schedules", default=",".join(schedules.SCHEDULES))
    parser.add_argument("--draw", default="", help="write one PNG per schedule (its smallest m) into this folder")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: p 2, m 4 and 8")
    args = parser.parse_args()
    if args.quick:
        args.stages, args.microbatches = 2, "4,8"
    p, rows = args.stages, []
    for name in args.schedules.split(","):
        v = args.repeats if name in schedules.CHUNKED else 1
        for m in (int(x) for x in args.microbatches.split(",")):
            table = schedules.executed(name, p, m, v)
            schedules.check(table, p, m, v, split=name in schedules.SPLIT_BACKWARD)
            rows.append({"schedule": name, "p": p, "m": m, "v": v, "ticks": len(table),
                         "bubble": schedules.bubble(table), "formula": schedules.formula(name, p, m, v),
                         "in_flight": schedules.in_flight(table)})
        if args.draw:
            folder = pathlib.Path(args.draw)
            folder.mkdir(parents=True, exist_ok=True)
            m = int(args.microbatches.split(",")[0])
            table = schedules.executed(name, p, m, v)
            draw(table, schedules.summary(name, p, m, v), folder / f"{name}.png")
            print(f"wrote {folder / f'{name}.png'}", file=sys.stderr)
    print(f"{'schedule':<17} {'p':>2} {'m':>3} {'v':>2} {'ticks':>6} {'bubble':>7} {'formula':>8}  in flight per stage")
    for r in rows:
        print(f"{r['schedule']:<17} {r['p']:>2} {r['m']:>3} {r['v']:>2} {r['ticks']:>6} {r['bubble']:>7.4f} "
              f"{r['formula']:>8.4f}  {r['in_flight']}")
    print(json.dumps({"bench": "schedules", "rows": rows}))


if __name__ == "__main__":
    main()
