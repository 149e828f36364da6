"""Run every benchmark (torch beside aelastic, same machine, same run) and write ``benchmarks/RESULTS.md``.

    python -m benchmarks [--quick] [--only agent,store_ops] [--repeats N] [--report-only]

Each module ``benchmarks/<name>.py`` runs as a subprocess with ``--json``, so one crashing benchmark cannot take
the others down and every module starts from a fresh interpreter. The report has, per scenario, the median and
min–max of every system and the ratio aelastic/torch; a PNG per scenario goes to ``plots/`` beside the report
(``benchmarks/plots/`` for ``RESULTS.md``), so a report written elsewhere (CI's ``--results``) leaves the committed
plots alone.

``--quick`` is the CI smoke run: a few repetitions, small sizes, and a failing exit status if aelastic's
standalone launch is slower than torchrun's. ``--report-only`` writes the report again from the results the last
run left in ``benchmarks/out/`` (with that run's date and duration), running nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODULES = ("store_ops", "rank_scale", "rendezvous", "agent", "goodput", "node_check", "job_etcd")
SUMMARY = HERE.parent / "docs" / "benchmarks" / "index.md"  # the documentation site's benchmark page
SUMMARY_START, SUMMARY_END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
OUT = HERE / "out"
GATE = ("agent", "launch")  # (benchmark, scenario) that --quick holds to "aelastic no slower than torchrun"

Record = dict[str, Any]


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor() or "unknown CPU",
    )  # fmt: skip
    mem_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    try:
        from importlib.metadata import version

        torch = version("torch")
    except Exception:  # torch is a benchmark dependency, not a package one
        torch = "not installed"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem_kib / 2**20:.0f} GiB, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch}, aelastic {aelastic_install()}"
    )


def aelastic_install() -> str:
    """How aelastic is installed in this environment, from the distribution's ``direct_url.json`` (PEP 610). An
    editable install used to cost every interpreter an import hook at start-up (setuptools' editable finder);
    hatchling's is a path in a ``.pth`` file, and both kinds now start as fast."""
    try:
        direct = importlib.metadata.distribution("aelastic").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (imported from the checkout)"
    editable = direct is not None and json.loads(direct).get("dir_info", {}).get("editable", False)
    return "editable install (pip install -e)" if editable else "regular install (pip install .)"


def run_module(name: str, quick: bool, repeats: int | None) -> list[Record]:
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", str(out)]
    if quick:
        cmd.append("--quick")
    if repeats is not None:
        cmd += ["--repeats", str(repeats)]
    print(f"$ {' '.join(cmd)}", flush=True)
    started = datetime.datetime.now()
    proc = subprocess.run(cmd, cwd=HERE.parent, check=False)
    took = datetime.datetime.now() - started
    if proc.returncode != 0 or not out.exists():
        print(f"benchmark {name} failed (exit {proc.returncode}) after {took}", file=sys.stderr)
        return []
    records: list[Record] = json.loads(out.read_text())["records"]
    for r in records:
        r["benchmark"] = name
    return records


def recorded(name: str) -> list[Record]:
    """The records another run left in ``out/<name>.json`` (the fault suite, the soak), or none."""
    path = OUT / f"{name}.json"
    if not path.exists():
        return []
    records: list[Record] = json.loads(path.read_text())["records"]
    for r in records:
        r["benchmark"] = name
    return records


# Sections from other runs: (file in out/, heading, what produced it).
RECORDED = (
    ("faults", "Fault scenarios", "the fault suite, `pytest tests/faults` and `pytest -m torchrun_compare "
     "tests/faults` (samples accumulate over runs)"),
    ("slurm", "Slurm test cluster", "the real-Slurm tests, `pytest tests/slurm` and `AELASTIC_SLURM_TORCHRUN=1 "
     "pytest tests/slurm/test_node_loss.py` (torchrun in the same template; samples accumulate over runs, the "
     "powered-off job-etcd rows from 2026-11-30 on, when held survivors stopped waiting out their grace)"),
    ("cuda_checkpoint", "GPU checkpoints", "`python -m benchmarks.cuda_checkpoint --json "
     "benchmarks/out/cuda_checkpoint.json` on a machine with a GPU (not in CI)"),
    ("soak", "Soak", "`python -m benchmarks.soak --minutes 10 --json benchmarks/out/soak.json` (not in CI)"),
    ("job_etcd_soak", "Job etcd soak", "`python -m benchmarks.job_etcd_soak --minutes 10 --json "
     "benchmarks/out/job_etcd_soak.json` (not in CI)"),
    ("hang", "Hang detection", "`python -m benchmarks.hang --minutes 10 --json benchmarks/out/hang.json` (not in CI)"),
    ("hang_verdicts", "Hang verdicts", "`python -m benchmarks.hang_verdicts --runs 20 --timeout 5 --json "
     "benchmarks/out/hang_verdicts.json` (not in CI)"),
    ("incidents", "Incident records", "`python -m benchmarks.incidents --minutes 10 --faults 5 --json "
     "benchmarks/out/incidents.json` (not in CI)"),
    ("frameworks", "Frameworks: what a fault and a checkpoint cost", "`python -m benchmarks.frameworks --part lost "
     "--json benchmarks/out/frameworks.json`, then `--part blocks` (each part keeps the other's rows; not in CI)"),
    ("store_fuzz", "Store fuzz campaign", "`python -m benchmarks.store_fuzz --minutes 10 --json "
     "benchmarks/out/store_fuzz.json` (not in CI)"),
)  # fmt: skip


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    number = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{number} {unit}".rstrip()


def ratio(ours: list[float], theirs: list[float], better: str) -> str:
    """aelastic / torch of the medians, and which way is better, so a reader needs no unit knowledge."""
    if not ours or not theirs:
        return ""
    mine, torch = statistics.median(ours), statistics.median(theirs)
    if torch == 0:  # a CPU-time row in a small run: torch's server spent less than the clock's 10 ms in user mode
        return "equal" if mine == 0 else f"– (torch's median is 0, {'worse' if better == 'lower' else 'better'})"
    r = mine / torch
    good = r <= 1 if better == "lower" else r >= 1
    return f"{r:.2f}× ({'better' if good else 'worse'})" if r >= 0.1 else f"{r:.2g}× ({'better' if good else 'worse'})"


def table(records: list[Record]) -> list[str]:
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if r["samples"]:  # a run with nothing to time (a fault scenario that never recovered) has an outcome
            groups[(r["benchmark"], r["scenario"])].append(r)
    lines = [
        "| benchmark | scenario | N | system | median | min – max | runs | aelastic / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (bench, scenario), rs in groups.items():
        by_param: dict[Any, dict[str, Record]] = defaultdict(dict)
        for r in rs:
            by_param[r["param"]][r["system"]] = r
        for param, systems in sorted(by_param.items(), key=lambda item: (item[0] is not None, item[0] or 0)):
            torch = next((r for s, r in systems.items() if s.startswith("torch")), None)
            for system, r in systems.items():
                s = r["samples"]
                cmp = ratio(s, torch["samples"], r["better"]) if torch is not None and r is not torch else ""
                lines.append(
                    f"| {bench} | {scenario} | {'' if param is None else param} | {system} | "
                    f"{fmt(statistics.median(s), r['unit'])} | {fmt(min(s), r['unit'])} – {fmt(max(s), r['unit'])} "
                    f"| {len(s)} | {cmp} |"
                )
    return lines


def plot(records: list[Record], directory: Path) -> list[Path]:
    """One PNG per scenario in ``directory``: median vs N where a scenario has several N, else a bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r["benchmark"], r["scenario"])].append(r)
    paths = []
    for (bench, scenario), rs in groups.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        unit = rs[0]["unit"]
        if any(r["param"] is not None for r in rs):
            by_system: dict[str, list[Record]] = defaultdict(list)
            for r in rs:
                by_system[r["system"]].append(r)
            for system, srs in sorted(by_system.items()):
                srs.sort(key=lambda r: r["param"])
                xs = [r["param"] for r in srs]
                ax.plot(xs, [statistics.median(r["samples"]) for r in srs], marker="o", label=system)
                ax.fill_between(xs, [min(r["samples"]) for r in srs], [max(r["samples"]) for r in srs], alpha=0.2)
            ax.set_xscale("log", base=2)
            medians = [statistics.median(r["samples"]) for r in rs]
            if min(medians) > 0 and max(medians) / min(medians) > 50:  # systems decades apart: show both
                ax.set_yscale("log")
            ax.set_xlabel("N")
            ax.legend()
        else:
            ax.bar([r["system"] for r in rs], [statistics.median(r["samples"]) for r in rs])
        ax.set_ylabel(unit)
        ax.set_title(f"{bench}: {scenario}")
        fig.tight_layout()
        path = directory / f"{bench}-{''.join(c if c.isalnum() else '_' for c in scenario)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def machine_state(run: dict[str, Any]) -> str:
    load = run.get("load")
    return f"load average (1 min) {load[0]} at the start, {load[1]} at the end" if load else "load not recorded"


# The site's summary shows one row per scenario: the largest N that torch and aelastic both ran.
SUMMARY_SCENARIOS = (
    ("agent", "launch", "no-op launch, `--standalone --nproc-per-node 2`"),
    ("agent", "c10d launch", "c10d launch"),
    ("agent", "scale-up", "scale-up (a node joins a running job)"),
    ("agent", "recovery", "recovery after a worker crash"),
    ("agent", "agent RSS", "agent RSS"),
    ("rendezvous", "total: all N join at once, until the last is released", "rendezvous, all N nodes at once"),
    ("rank_scale", "raw client: time", "workers' store, N simulated ranks (raw client)"),
    ("rank_scale", "torch client: time", "workers' store, N simulated ranks (torch's C++ client)"),
    ("store_ops", "set ops/s", "store SET ops/s (8 torch clients)"),
    ("store_ops", "get ops/s", "store GET ops/s"),
    ("store_ops", "add ops/s", "store ADD ops/s"),
    ("store_ops", "WAIT wake-up p50", "store WAIT wake-up p50"),
)


def summary_table(records: list[Record], run: dict[str, Any]) -> list[str]:
    lines = [
        f"One run of `python -m benchmarks` on {run['started']} UTC ({run['took_s'] // 60} min), "
        f"{run['machine']}; {machine_state(run)}. Medians; torch and aelastic alternate in the same run. "
        "Full tables, every N, plots: [the full results](results.md) (benchmarks/RESULTS.md).",
        "",
        "| scenario | N | torch | aelastic | aelastic / torch |",
        "|---|---|---|---|---|",
    ]
    for bench, scenario, title in SUMMARY_SCENARIOS:
        rs = [r for r in records if (r["benchmark"], r["scenario"]) == (bench, scenario) and r["samples"]]
        by_param: dict[Any, dict[str, Record]] = defaultdict(dict)
        for r in rs:
            by_param[r["param"]][r["system"]] = r
        both = [
            p for p, systems in by_param.items() if any(s.startswith("torch") for s in systems) and len(systems) > 1
        ]
        if not both:
            continue
        param = max(both, key=lambda p: (p is not None, p or 0))
        systems = by_param[param]
        torch = next(r for s, r in systems.items() if s.startswith("torch"))
        for system, r in systems.items():
            if not system.startswith("aelastic"):  # torch, and store_ops' floors (in RESULTS.md only)
                continue
            name = title if system == "aelastic" else f"{title}, {system.removeprefix('aelastic ')}"
            lines.append(
                f"| {name} | {'' if param is None else f'{param:,}'} | "
                f"{fmt(statistics.median(torch['samples']), r['unit'])} | "
                f"{fmt(statistics.median(r['samples']), r['unit'])} | "
                f"{ratio(r['samples'], torch['samples'], r['better'])} |"
            )
    return lines


def write_summary(records: list[Record], run: dict[str, Any]) -> None:
    """Replace the site's benchmark table (between its two markers) with this run's figures: the one place a
    figure is quoted outside RESULTS.md (other pages name its rows)."""
    text = SUMMARY.read_text()
    start, end = text.find(SUMMARY_START), text.find(SUMMARY_END)
    if start < 0 or end < start:
        print(f"{SUMMARY}: no {SUMMARY_START} ... {SUMMARY_END} markers; its table is left alone", file=sys.stderr)
        return
    table_text = "\n".join(summary_table(records, run))
    SUMMARY.write_text(text[: start + len(SUMMARY_START)] + "\n" + table_text + "\n" + text[end:])


def gate(records: list[Record]) -> str | None:
    """The CI smoke check: aelastic's standalone launch no slower than torchrun's (medians)."""
    rs = [r for r in records if (r["benchmark"], r["scenario"]) == GATE]
    ours = [r for r in rs if r["system"] == "aelastic"]
    theirs = [r for r in rs if r["system"].startswith("torch")]
    if not ours or not theirs:
        return f"the {GATE[0]} benchmark produced no {GATE[1]!r} result for both systems"
    a, t = statistics.median(ours[0]["samples"]), statistics.median(theirs[0]["samples"])
    if a > t:
        return f"aelastic's standalone launch took {a:.3f} s, torchrun's {t:.3f} s: aelastic must not be slower"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: small sizes, few repetitions")
    parser.add_argument("--only", default=",".join(MODULES), help="comma list of benchmarks (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per scenario (default: each one's)")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="where to write the report")
    parser.add_argument("--report-only", action="store_true", help="report the last run's results; run nothing")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(MODULES))
    if unknown:
        parser.error(f"--only {args.only!r}: unknown benchmark(s) {unknown}; choose from {', '.join(MODULES)}")

    if args.report_only:
        run = json.loads((OUT / "run.json").read_text())
        names = run["names"]
        records = [r for name in names for r in recorded(name)]
    else:
        started = datetime.datetime.now(datetime.timezone.utc)
        load = [f"{os.getloadavg()[0]:.2f}"]
        records = [r for name in names for r in run_module(name, args.quick, args.repeats)]
        took = datetime.datetime.now(datetime.timezone.utc) - started
        load.append(f"{os.getloadavg()[0]:.2f}")
        run = {"started": f"{started:%Y-%m-%d %H:%M}", "took_s": took.seconds, "quick": args.quick, "names": names,
               "machine": machine(), "load": load}  # fmt: skip
        (OUT / "run.json").write_text(json.dumps(run, indent=1))
    failed = [n for n in names if not any(r["benchmark"] == n for r in records)]

    quick = " --quick" if run["quick"] else ""
    report = [
        "# aelastic benchmarks",
        "",
        f"Run {run['started']} UTC{' (quick)' if run['quick'] else ''}, took {run['took_s'] // 60} min "
        f"{run['took_s'] % 60} s: `python -m benchmarks{quick}`.",
        f"Machine: {run['machine']}; {machine_state(run)}.",
        "",
        "Medians of the repetitions; systems alternate within each repetition. Ratios are aelastic / torch. Every "
        "figure below is from this one run; earlier rounds and their figures are in [HISTORY.md](HISTORY.md).",
        "",
        *table(records),
        "",
    ]
    if failed:
        report += [f"Failed to produce results: {', '.join(failed)}.", ""]
    for name, heading, source in RECORDED:
        extra = recorded(name)
        if extra:
            report += [f"## {heading}", "", f"From {source}:", "", *table(extra), ""]
            report += [f"- {r['scenario']}: {r['what']}" for r in extra if r.get("what") and r["samples"]] + [""]
            outcomes = [r for r in extra if r.get("outcome")]
            if outcomes:
                report += ["What happened, per system:", ""]
                report += [f"- **{r['system']}**, {r['scenario']}: {r['outcome']}" for r in outcomes] + [""]
    paths = plot(records, args.results.parent / "plots") if records else []
    report += [f"![{p.stem}](plots/{p.name})" for p in paths]
    args.results.write_text("\n".join(report) + "\n")
    print("\n".join(table(records)))
    print(f"wrote {args.results}")
    if not run["quick"] and args.results == HERE / "RESULTS.md" and set(names) == set(MODULES):
        write_summary(records, run)
        print(f"wrote the benchmark table of {SUMMARY}")

    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    problem = gate(records) if run["quick"] and "agent" in names else None
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
