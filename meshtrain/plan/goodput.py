"""Goodput at scale, modeled: the share of a run's wall clock that trains, and the checkpoint
intervals that maximise it (`python -m meshtrain.plan --goodput`).

A run of N GPUs is interrupted at a rate that grows with N. Each unplanned interruption costs a
restart (detecting it, rescheduling, starting the processes, compiling or reading the compiled step
back, restoring) and the work since the newest complete checkpoint; each planned one (maintenance)
costs a restart after a save. Each save blocks the step loop for its device-to-host copy (meshtrain's
saves are asynchronous: the writes go on behind the next steps) and completes a write time later.

Per tier saving every tau seconds of work, blocking delta, written w after it starts, restored in r:

    goodput = (1 - sum over interruptions of rate x cost) / (1 + sum over tiers of delta / tau)
    cost of an unplanned interruption = restart + r + tau / 2 + w   (of the tier it restores from)

(a failure at a uniform point of an interval loses the time since the interval began, and the whole
previous interval too while the newest save is still being written: tau / 2 + w on average). The
interval that maximises it is near Young's sqrt(2 delta M) (M: the mean time between the failures
that tier restores) and no shorter than w; it is chosen by a search over whole steps.

Two tiers: a local one (host memory, each host's shards also copied to a peer host in a ring) that
restores every failure except one that also takes the peer before the restart has read its copy
(probability 1 - exp(-host failure rate x restart)), and the persistent one (a shared file system)
for those. The persistent tier alone restores every failure from the file system.

The default failure rates are the Llama 3 paper's (Section 3.3.4: 466 interruptions of a 16,384-GPU
job in a 54-day snapshot, 419 unexpected, 47 planned) and its file system's sustained bandwidth
(Section 3.3.1: Tectonic, 2 TB/s); the host link is PCIe Gen5 x16 (64 GB/s a direction) on H100 / H200
/ B200 servers. The restart time is an assumption, printed as one, with the largest restart that
still reaches the goodput target.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from meshtrain.plan import memory

HOUR = 3600.0
# Llama 3 (2024), Section 3.3.4: a 54-day snapshot of the 405B pre-training on 16,384 H100s
LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_UNPLANNED, LLAMA3_PLANNED = 16_384, 54, 419, 47
LLAMA3_FAILURE_RATE = LLAMA3_UNPLANNED / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)  # per GPU-hour
LLAMA3_PLANNED_RATE = LLAMA3_PLANNED / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
LLAMA3_EFFECTIVE = 0.90  # "higher than 90% effective training time"
TECTONIC_BANDWIDTH = 2e12  # Section 3.3.1: bytes/s sustained (7 TB/s peak)
RESTART_SECONDS = 300.0  # assumed: detection, rescheduling, process start, distributed init, compile from cache
TARGET = 0.95
SOURCES = (
    f"failure rates: Llama 3 (2024) Section 3.3.4, {LLAMA3_UNPLANNED} unexpected and {LLAMA3_PLANNED} planned "
    f"interruptions of {LLAMA3_GPUS:,} GPUs in {LLAMA3_DAYS} days",
    "persistent bandwidth: Llama 3 Section 3.3.1, Tectonic's 2 TB/s sustained (read and write alike)",
    "host link: PCIe Gen5 x16, 64 GB/s a direction a GPU (the GPU table's host_bandwidth)",
    "peer copy: the GPU table's network bandwidth a GPU",
    "restart: assumed unless --restart_seconds is given (measure yours: `meshtrain.report`'s start-up badput)",
)


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    host_bandwidth: float  # bytes/s a GPU, device <-> host, one direction
    network_bandwidth: float  # bytes/s a GPU, one direction, between hosts
    gpus_per_host: int = 8
    failure_rate: float = LLAMA3_FAILURE_RATE  # unplanned interruptions per GPU-hour
    planned_rate: float = LLAMA3_PLANNED_RATE
    restart_seconds: float = RESTART_SECONDS
    persistent_bandwidth: float = TECTONIC_BANDWIDTH  # bytes/s for the whole job, write and read

    @property
    def mtbf(self) -> float:
        """Seconds between unplanned interruptions of the whole job."""
        return HOUR / (self.failure_rate * self.gpus)

    @property
    def planned_interval(self) -> float:
        return HOUR / (self.planned_rate * self.gpus) if self.planned_rate else math.inf


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    blocking: float  # seconds the step loop waits a save
    write: float  # seconds from a save's start to its completion
    restore: float  # seconds to read it back on a restart


@dataclasses.dataclass(frozen=True)
class Plan:
    """The best intervals for one choice of tiers and what they give."""
    tiers: tuple[Tier, ...]
    every: tuple[int, ...]  # steps between saves, per tier
    step_seconds: float
    lost_fraction: tuple[float, ...]  # of unplanned interruptions restored from each tier
    goodput: float
    restart_budget: float  # the largest restart (seconds) that still gives TARGET

    @property
    def seconds(self) -> tuple[float, ...]:
        return tuple(k * self.step_seconds for k in self.every)

    def as_json(self) -> dict:
        return {"tiers": [dataclasses.asdict(t) for t in self.tiers], "every_steps": list(self.every),
                "every_seconds": list(self.seconds), "restored_from": list(self.lost_fraction),
                "goodput": self.goodput, "restart_budget_seconds": self.restart_budget}


def checkpoint_bytes(model) -> int:
    """Bytes of a training checkpoint: the parameters and Adam's two moments in `model.param_dtype`."""
    return 3 * memory.num_params(model) * memory.dtype_bytes(model.param_dtype)


def tiers(total_bytes: float, cluster: Cluster) -> tuple[Tier, Tier]:
    """(local, persistent). Saving splits the state evenly over the GPUs (replicas write slices of what
    they share): each copies total / N bytes to its host, blocking the step; the local tier's exchange
    with the peer (device to device, `local_tier`) blocks it too; the persistent tier's write of the
    whole state to the file system goes on behind the next steps."""
    per_gpu = total_bytes / cluster.gpus
    to_host = per_gpu / cluster.host_bandwidth
    to_peer = per_gpu / cluster.network_bandwidth  # a host's GPUs' NICs carry its bytes side by side
    to_files = total_bytes / cluster.persistent_bandwidth
    return (Tier("local", to_host + to_peer, to_host + to_peer, to_host + to_peer),  # the exchange blocks too
            Tier("persistent", to_host, to_host + to_files, to_files + to_host))


def _goodput(cluster: Cluster, restart: float, tiers_: tuple[Tier, ...], shares: tuple[float, ...],
             taus) -> np.ndarray:
    """The formula of the module docstring; `taus` per tier (arrays broadcast together)."""
    rate = 1 / cluster.mtbf + 1 / cluster.planned_interval
    back = sum(share * math.exp(-rate * (restart + t.restore)) for t, share in zip(tiers_, shares, strict=True))
    planned = math.exp(-rate * (restart + tiers_[0].restore))  # a save just before: nothing lost
    lost = sum(share * (tau / 2 + t.write) for t, share, tau in zip(tiers_, shares, taus, strict=True))
    useful = (back / cluster.mtbf + planned / cluster.planned_interval) / rate
    return (useful - lost / cluster.mtbf) / (1 + sum(t.blocking / tau for t, tau in zip(tiers_, taus, strict=True)))


def _candidates(lowest: int) -> np.ndarray:
    """Whole-step intervals from `lowest` up: every one to 64, then up to 800 spaced geometrically to a
    million steps."""
    dense = np.arange(lowest, max(lowest, 64) + 1)
    spread = np.unique(np.round(np.geomspace(max(lowest, 64), 1e6, 800)).astype(np.int64))
    return np.unique(np.concatenate([dense, spread]))


def best(cluster: Cluster, step_seconds: float, total_bytes: float, two_tiers: bool) -> Plan:
    """The intervals (whole steps, each no shorter than its tier's write) that maximise goodput."""
    local, persistent = tiers(total_bytes, cluster)
    if two_tiers:
        # the local copy is lost with the failed host and its peer; the peer fails in the restart at this rate
        lost = 1 - math.exp(-cluster.failure_rate * cluster.gpus_per_host * cluster.restart_seconds / HOUR)
        chosen, shares = (local, persistent), (1 - lost, lost)
    else:
        chosen, shares = (persistent,), (1.0,)
    grids = [_candidates(max(1, math.ceil(t.write / step_seconds))) * step_seconds for t in chosen]
    every = [g[0] for g in grids]
    for _ in range(4):  # coordinate ascent: the tiers couple only through the blocking sum
        for i, grid in enumerate(grids):
            taus = [grid if j == i else every[j] for j in range(len(chosen))]
            every[i] = grid[int(np.argmax(_goodput(cluster, cluster.restart_seconds, chosen, shares, taus)))]
    value = float(_goodput(cluster, cluster.restart_seconds, chosen, shares, every))
    return Plan(chosen, tuple(int(round(t / step_seconds)) for t in every), step_seconds, shares, value,
                _restart_budget(cluster, chosen, shares, every))


def _restart_budget(cluster: Cluster, chosen, shares, every) -> float:
    """The restart seconds at which goodput, at these intervals, falls to TARGET (0: below it even with
    an instant restart); found by bisection, goodput falling as the restart grows."""
    def at(restart: float) -> float:
        return float(_goodput(cluster, restart, chosen, shares, every))

    if at(0.0) < TARGET:
        return 0.0
    lo, hi = 0.0, cluster.mtbf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) >= TARGET else (lo, mid)
    return lo


def persistent_floor(cluster: Cluster, step_seconds: float, total_bytes: float) -> float:
    """The lowest persistent bandwidth (bytes/s) at which the persistent tier alone, at its best interval,
    still reaches TARGET (inf: not even at any bandwidth): below it, the local tier is what keeps the goal."""
    def reaches(bandwidth: float) -> bool:
        trial = dataclasses.replace(cluster, persistent_bandwidth=bandwidth)
        return best(trial, step_seconds, total_bytes, two_tiers=False).goodput >= TARGET

    lo, hi = math.log(1e6), math.log(1e16)  # bytes/s
    if not reaches(math.exp(hi)):
        return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(math.exp(mid)) else (mid, hi)
    return math.exp(hi)


def report(plans: dict[str, Plan], cluster: Cluster, total_bytes: float, label: str, floor: float) -> str:
    """The goodput table and the figures it rests on."""
    lines = [f"goodput of {label} on {cluster.gpus:,} GPUs: checkpoint {total_bytes / 1e12:.2f} TB "
             f"({total_bytes / cluster.gpus / 1e6:,.0f} MB a GPU)",
             f"unplanned interruptions: {cluster.failure_rate:.3g} per GPU-hour, one every "
             f"{cluster.mtbf / HOUR:.2f} h; planned: one every {cluster.planned_interval / HOUR:.1f} h; "
             f"restart {cluster.restart_seconds:.0f} s"
             + (" (assumed)" if cluster.restart_seconds == RESTART_SECONDS else ""),
             ""]
    rows = [("tiers", "saves every (steps / s)", "blocking a save", "written in", "restored in", "goodput",
             f"restart for {TARGET:.0%}")]
    for name, plan in plans.items():
        rows.append((name,
                     " + ".join(f"{t.name} {k:,} / {k * plan.step_seconds:,.0f}"
                                for t, k in zip(plan.tiers, plan.every, strict=True)),
                     " + ".join(f"{t.blocking * 1e3:.1f} ms" for t in plan.tiers),
                     " / ".join(f"{t.write:.2f} s" for t in plan.tiers),
                     " / ".join(f"{t.restore:.2f} s" for t in plan.tiers),
                     f"{plan.goodput:.2%}", f"<= {plan.restart_budget:,.0f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += ["", f"the persistent tier alone reaches {TARGET:.0%} down to {floor / 1e9:,.1f} GB/s of persistent "
              f"bandwidth (this run's: {cluster.persistent_bandwidth / 1e9:,.1f} GB/s);",
              "below it the local tier is what keeps the goal",
              "", "sources:", *(f"  {s}" for s in SOURCES)]
    return "\n".join(lines)


def simulate(cluster: Cluster, plan: Plan, interruptions: int = 20_000, seed: int = 0) -> float:
    """Goodput of `plan` by simulation, to check the formula: exponential times between interruptions
    (unplanned and planned), a run that saves after every step a multiple of each tier's interval (its
    step loop blocked `blocking`, the save complete `write` later), and on an unplanned interruption a
    restart (itself interrupted by a failure that comes before it ends) from the newest save complete
    in a tier that survived. Returns trained seconds over wall seconds."""
    rng = np.random.default_rng(seed)
    s, tiers_ = plan.step_seconds, plan.tiers
    rate = 1 / cluster.mtbf + 1 / cluster.planned_interval
    planned_share = (1 / cluster.planned_interval) / rate

    def wall(p0: int, p: int) -> float:
        """Wall seconds from a restart at step p0 to the end of step p (its saves' blocking included)."""
        return (p - p0) * s + sum(t.blocking * (p // k - p0 // k) for t, k in zip(tiers_, plan.every, strict=True))

    position, clock = 0, 0.0
    restore = tiers_[0].restore
    for _ in range(interruptions):
        gap = rng.exponential(1 / rate)
        ready = cluster.restart_seconds + restore  # a restart interrupted before it ends begins again
        if gap < ready:
            clock += gap
            continue
        clock += gap
        budget = gap - ready
        lo, hi = position, position + int(budget / s) + 1  # the last step finished inside the budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if wall(position, mid) <= budget else (lo, mid - 1)
        reached = lo
        if rng.random() < planned_share:  # maintenance: saved first, nothing lost
            position, restore = reached, tiers_[0].restore
            continue
        local_kept = len(tiers_) == 2 and rng.random() >= plan.lost_fraction[-1]  # else gone with host and peer
        best_position, restore = position, tiers_[-1].restore
        for k, tier in zip(plan.every, tiers_, strict=True):
            if tier.name == "local" and not local_kept:
                continue
            m = reached // k * k
            while m > position and wall(position, m) - tier.blocking + tier.write > budget:
                m -= k  # still being written when the failure came
            if m >= best_position:
                best_position, restore = m, tier.restore
        position = best_position
    return position * s / clock
