"""FP8 numerics: the tiny model trained in bf16 and in fp8 matmuls on the default corpus, curves and
final losses, and the step's cost on this machine.

    python bench/fp8.py [--steps 300] [--out bench/fp8_curves.png] [--workdir DIR]

Playbook, "Mixed Precision Training" / "FP8 pretraining": FP8 training is usable when its loss
follows the higher-precision run's and never diverges. Both runs use `configs/tiny.py` as it is
(bf16 compute, 8 fake CPU devices, data-parallel, the embedded corpus) and differ only in
`model.matmul_precision`. On a CPU the quantisation is emulated (quantise -> dequantise around a
bf16 matmul), so it computes FP8's numbers but not its speed: the step times only show the
emulation's overhead. Prints a table, writes the two curves to a PNG, and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from meshtrain import train  # noqa: E402
from tests import utils  # noqa: E402

TAIL = 20  # steps averaged for the "final" loss besides the last step's own


def run(precision: str, steps: int, workdir: pathlib.Path) -> list[dict]:
    config = utils.load_config_file("tiny")
    config.steps, config.log_every, config.workdir = steps, 1, str(workdir / precision)
    config.train.warmup_steps = min(config.train.warmup_steps, steps)  # the --quick run is shorter than it
    config.model.matmul_precision = precision
    train.run(config)
    with open(workdir / precision / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def summary(records: list[dict]) -> dict:
    losses = [float(r["loss"]) for r in records]
    times = [r["step_time_s"] for r in records[5:]]
    return {"first_loss": losses[0], "final_loss": losses[-1], f"mean_last_{TAIL}": statistics.fmean(losses[-TAIL:]),
            "max_loss": max(losses), "finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
            "median_step_s": statistics.median(times), "losses": losses}


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for precision, s in results.items():
        ax.plot(range(1, len(s["losses"]) + 1), s["losses"], label=f"{precision} (final {s['final_loss']:.4f})",
                linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("configs/tiny.py: bf16 vs fp8 matmuls")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name("fp8_curves.png")))
    parser.add_argument("--workdir", default="")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: 8 steps, the plot written to a temporary folder")
    args = parser.parse_args()
    if args.quick:
        args.steps = 8
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        results = {p: summary(run(p, args.steps, workdir)) for p in ("bf16", "fp8")}
        if args.quick:
            args.out = str(pathlib.Path(tmp) / "fp8_curves.png")
        plot(results, pathlib.Path(args.out))
    bf16, fp8 = results["bf16"], results["fp8"]
    gap = (fp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
    gap_tail = (fp8[f"mean_last_{TAIL}"] - bf16[f"mean_last_{TAIL}"]) / bf16[f"mean_last_{TAIL}"]
    print(f"{'precision':<10}{'first':>9}{'final':>9}{f'last {TAIL}':>9}{'max':>9}{'finite':>8}{'step s':>9}")
    for precision, s in results.items():
        print(f"{precision:<10}{s['first_loss']:>9.4f}{s['final_loss']:>9.4f}{s[f'mean_last_{TAIL}']:>9.4f}"
              f"{s['max_loss']:>9.4f}{str(s['finite']):>8}{s['median_step_s']:>9.3f}")
    print(f"fp8 - bf16 final loss: {gap * 100:+.2f}% (last step), {gap_tail * 100:+.2f}% (mean of last {TAIL}); "
          f"curves: {args.out}")
    out = {"bench": "fp8", "steps": args.steps, "final_gap": gap, f"final_gap_last_{TAIL}": gap_tail,
           **{f"{p}_{k}": v for p, s in results.items() for k, v in s.items() if k != "losses"}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
