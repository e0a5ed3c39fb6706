"""python -m benchmarks.study {plan,run,report} SPEC: an honest comparison of CLIP objectives on any data.

    python -m benchmarks.study plan benchmarks/study/v2.yaml            # every run, budgets, the choice rule
    python -m benchmarks.study plan benchmarks/study/v2.yaml --hours    # core-hours (--measure: time a short run)
    python -m benchmarks.study run benchmarks/study/v2.yaml --cell scenes-semantic/32/dcl --parallel 2
    python -m benchmarks.study run benchmarks/study/v2.yaml --cell 'scenes-semantic/32/*' --phase tune --phase test
    python -m benchmarks.study report benchmarks/study/v2.yaml          # tables + summary JSON

Usage mistakes (a spec, a cell, mixed code in a table) are one line and exit 2."""

from __future__ import annotations

import signal
import sys

from .stops import Stopped, handled, raise_stopped, stopped_line


def _stopped_while_importing(signum, frame):
    command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("plan", "run", "report") else ""
    print(stopped_line(command, signal.Signals(signum).name), file=sys.stderr)
    raise SystemExit(75)


if __name__ == "__main__":  # a stop is one line from here on, the imports (torch: seconds) included; main() takes over
    for _signum in handled():
        signal.signal(_signum, _stopped_while_importing)

import difflib  # noqa: E402
import fnmatch  # noqa: E402
import os  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

from fastclip.cli import OneLineParser, whole_number  # noqa: E402
from fastclip.data.manifest import ManifestError  # noqa: E402

from . import hours, records, runner, settings  # noqa: E402
from .plan import EDGE_STEPS, PHASES, budget, cell_name, cells, plan  # noqa: E402
from .spec import SpecError, load  # noqa: E402


def _count(least: int):
    def parse(text: str) -> int:
        return whole_number(text, least)

    parse.__name__ = "count"
    return parse


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m benchmarks.study", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="list the runs, budgets and what is done")
    p.add_argument("spec")
    p.add_argument(
        "--hours", action="store_true", help="core-hours from the finished runs' wall time (else a timing run's)"
    )
    p.add_argument("--measure", action="store_true", help="time a short run per dataset and batch first")
    p.add_argument(
        "--price-from",
        metavar="SPEC",
        help="with --hours: price batches without finished runs from SPEC's finished runs of the same architecture",
    )
    p.add_argument("--list", action="store_true", help="print every run id")
    r = sub.add_parser("run", help="run pending runs (resumes stopped ones)")
    r.add_argument("spec")
    r.add_argument(
        "--cell",
        action="append",
        help="only this dataset/batch/objective (repeat for several; shell-style patterns: 'scenes-semantic/32/*')",
    )
    r.add_argument("--max-runs", type=_count(0))
    r.add_argument(
        "--phase",
        action="append",
        choices=PHASES,
        help="only runs of this phase (repeat for several; default all): e.g. tune and test of every headline cell "
        "before their long runs",
    )
    r.add_argument("--parallel", type=_count(1), default=1)
    r.add_argument("--allow-mixed-commits", action="store_true")
    r.add_argument("--rerun-stale", action="store_true", help="re-run the runs of other code (moved to stale/)")
    s = sub.add_parser("report", help="print and write the tables and the summary JSON")
    s.add_argument("spec")
    s.add_argument("--allow-mixed-commits", action="store_true")
    s.add_argument(
        "--backfill-tau",
        action="store_true",
        help="first give finished records made before runs kept final.tau theirs, from their run folders' metrics",
    )
    return parser


def _h(hours: float) -> str:
    """Hours to 0.1 from 1, below to 0.01 or 0.001 (a small study's 0.034 is not 0.0)."""
    if hours == 0 or hours >= 0.95:
        return f"{hours:.1f}"
    return f"{hours:.2f}" if hours >= 0.1 else f"{hours:.3f}" if hours >= 0.001 else "<0.001"


def cmd_plan(spec, args) -> int:
    if args.measure and args.price_from:
        raise SpecError("--measure and --price-from both price the batches without finished runs; give one")
    settings.check_settings(spec)
    runs = plan(spec)
    per_budget = budget(spec)
    finished = [(r, rec) for r in runs if not r.chosen_pending and (rec := records.load(spec.results, r.id))]
    phases = Counter(r.phase for r in runs)
    now = records.code_version()["code"]
    stale = sum(1 for r, rec in finished if runner.code_of(spec, r, rec) != now)
    print(
        f"study {spec.name}: {len(runs)} runs ({', '.join(f'{n} {p}' for p, n in phases.items())}), {len(finished)} "
        "done" + (f" ({stale} from other code or data than now: `run --rerun-stale` runs them again)" if stale else "")
    )
    fewer = "; ".join(
        f"{n} at {at} only" if (at := spec.batches_of(n)) else f"{n} at none of them (its batches: {list(o.batches)})"
        for n, o in spec.objectives.items()
        if o.batches
    )
    print(
        f"cells: {len(cells(spec))} (datasets {list(spec.datasets)} x batches {list(spec.batches)} x objectives"
        + (f"; {fewer})" if fewer else ")")
    )
    print(
        f"tuning budget per cell: {next(iter(per_budget.values()))} runs for every objective "
        f"({next(iter(per_budget.values())) // len(spec.tune_seeds)} settings x {len(spec.tune_seeds)} seeds); "
        f"chosen on val: the best mean of the {len(spec.tune_seeds)} tuning seeds, past a grid's edge by up to "
        f"{EDGE_STEPS} steps per knob while a step wins ({len(spec.tune_seeds)} runs each)"
    )
    headline = [n for n, o in spec.objectives.items() if o.headline]
    print(
        f"test seeds: {len(spec.test_seeds)} for {headline} and for each table's winner and strongest baseline "
        f"(named on val), {len(spec.other_test_seeds)} for the others; longer training: x{spec.long_factor} epochs "
        f"for the same, {len(spec.long_seeds)} seeds"
    )
    if args.list:
        for r in runs:
            print(r.id)
    if args.hours or args.measure or args.price_from:
        path = hours.timing_file(spec)
        fix = "delete it and time again with `plan --hours --measure`"
        timing = hours.measure(spec) if args.measure else records.read_json(path, fix) if path.is_file() else {}
        per_step = timing.get("seconds_per_step", {}) if isinstance(timing, dict) else None
        if not (isinstance(per_step, dict) and all(isinstance(v, (int, float)) for v in per_step.values())):
            raise SpecError(f"{path}: no `seconds_per_step` mapping of numbers; {fix}")
        measured = hours.from_runs(spec)
        lent, sources = {}, {}
        if args.price_from:
            try:
                lent, sources = hours.borrowed(spec, load(Path(args.price_from)), own=measured)
            except SpecError as error:
                raise SpecError(f"--price-from {args.price_from}: {error}") from None
        try:
            h = hours.core_hours(spec, per_step, {**lent, **measured})
        except KeyError as missing:
            lent_note = f" (and {args.price_from} has no finished run to price it from)" if args.price_from else ""
            raise SpecError(
                f"--hours: {missing} has no finished run and no timing in {path}{lent_note}; measure it with "
                "`plan --hours --measure`"
            ) from None
        print(
            f"core-hours: {_h(h['total'])} in total, {_h(h['headline'])} for the headline objectives; "
            f"{_h(h['done'])} done (their wall time), {_h(h['pending'])} pending (a floor: a step past a grid's "
            f"edge, {len(spec.tune_seeds)} runs, counts once it is taken)"
        )
        if h["pending_by"]:
            print(
                "  pending by table and phase: "
                + ", ".join(f"{k} {_h(v)}" for k, v in h["pending_by"].items())
                + f"; at best {_h(h['pending'] / (os.cpu_count() or 1))} h on this machine's {os.cpu_count()} cores "
                "(one run per free core, no core idle while a run waits for a choice)"
            )
        if measured:
            print(
                "  wall seconds per step of the finished runs (median; evaluation included, at the load they ran "
                "at): " + ", ".join(f"{k} {v:.3f} ({n} runs)" for k, (v, n) in sorted(measured.items()))
            )
        if lent:
            print(
                f"  priced from {args.price_from}'s finished runs (wall seconds per step, median): "
                + ", ".join(
                    f"{k} {v:.3f} ({n} runs of {sources[k.split('/')[0]]})" for k, (v, n) in sorted(lent.items())
                )
            )
        if h["timed"]:
            print(
                f"  {', '.join(h['timed'])} without finished runs: a timing run's seconds per training step ("
                + ", ".join(f"{k} {per_step[k]:.3f}" for k in h["timed"])
                + "; evaluation not counted)"
            )
            note = hours.busy_note(timing)
            if note:
                print(f"  note: {note}")
    return 0


def cmd_run(spec, args) -> int:
    every = [cell_name(*cell) for cell in cells(spec)]
    for pattern in args.cell or ():
        if not any(fnmatch.fnmatchcase(c, pattern) for c in every):
            name = pattern.split("/")[-1]
            objective = spec.objectives.get(name)
            only = ""
            if objective and objective.batches:
                at = spec.batches_of(name)
                only = f"; {name} runs at batch(es) {at} only" if at else f"; {name} runs at none of its batches"
                only += f" (its batches: {list(objective.batches)})"
            close = difflib.get_close_matches(pattern, every, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            if pattern.count("/") < 2:
                hint += f" (a pattern covers several: '{pattern.rstrip('/')}/*')"
            shown = ", ".join(every[:6]) + (f", ... ({len(every)} in all)" if len(every) > 6 else "")
            raise SpecError(f"--cell {pattern}: matches no cell of {spec.path} (dataset/batch/objective){only}{hint}; "
                            f"cells: {shown}")  # fmt: skip
    named = [c for c in every if any(fnmatch.fnmatchcase(c, p) for p in args.cell)] if args.cell else None  # None: all
    if spec.device == "cuda":  # (plan may price a GPU study anywhere; its runs would each fail here)
        import torch

        if not torch.cuda.is_available():
            raise SpecError(f"{spec.path}: device cuda, but this machine has no usable CUDA device; run it where "
                            "one is, or set device: cpu")  # fmt: skip
    settings.check_settings(spec)
    runner.check_outputs(spec)
    with runner.hold_lock(spec):
        return _run(spec, args, named)


def _run(spec, args, named) -> int:
    """`run` once the study is locked: provenance, then the pending runs."""
    current = records.code_version()
    moved = runner.move_stale(spec, current["code"], named) if args.rerun_stale else []
    if not args.allow_mixed_commits:
        try:
            runner.check_commits(spec, current["code"], named, rerun_stale=args.rerun_stale)
        except runner.MixedCommits:
            runner.put_back(spec, moved)  # refused: the tables as they were (it moved, then refused to run)
            raise
    if args.rerun_stale:
        print(f"{len(moved)} run(s) from other code moved to {spec.results / 'stale'}; they run again")
    if current["dirty"]:
        print(f"note: fastclip/ or configs/ has uncommitted changes; runs record code {current['code']}")
    try:
        phases = tuple(args.phase) if args.phase else PHASES
        failed = runner.run_pending(
            spec,
            cell=named,
            max_runs=args.max_runs,
            parallel=args.parallel,
            phases=phases,
            code=None if args.allow_mixed_commits else current["code"],
        )
    except Stopped as signal_name:
        print(
            f"python -m benchmarks.study run: stopped by {signal_name}: the runs in progress were stopped, each "
            "keeping its last checkpoint; `run` again resumes them",
            file=sys.stderr,
        )
        return 75
    if failed:
        print(f"{failed} run(s) failed (logs under {spec.work / 'runs'}); the next `run` retries them", file=sys.stderr)
        return 1
    return 0


def cmd_report(spec, args) -> int:
    if not args.allow_mixed_commits:
        runner.check_commits(spec, None)
    from . import report  # scipy: not needed to run (a lent GPU machine may lack it)

    if args.backfill_tau:
        filled, without = runner.backfill_tau(spec)
        print(
            f"backfill-tau: {filled} record(s) given final.tau from their metrics.jsonl, {without} without a run folder"
        )

    for key, path in (("report_md", spec.report_md), ("summary_json", spec.summary_json)):
        if path.is_dir():
            raise SpecError(f"{key} {path}: is a directory; give a file name")
    if spec.results.exists() and not spec.results.is_dir():
        raise SpecError(f"results {spec.results}: is a file; give a folder")
    for key, path in (("report_md", spec.report_md), ("summary_json", spec.summary_json)):  # (the figures beside)
        runner.check_writable("results" if path.parent == spec.results else key, path.parent)
    text, _ = report.write(spec)
    print(text)
    print(f"\nwrote {spec.report_md} and {spec.summary_json}")
    return 0


def main(argv: list[str] | None = None, handle_signals: bool = False) -> int:
    """The command line. handle_signals (the `python -m` entry): a stop is one line, exit 75 (`run` requeues;
    nothing started is lost; plan and report change nothing until their end); in-process callers keep their own
    handlers (`run`'s loop still stops its trainers on a stop)."""
    args = build_parser().parse_args(argv)
    previous = {s: signal.signal(s, raise_stopped) for s in (handled() if handle_signals else [])}
    try:
        spec = load(args.spec)
        return {"plan": cmd_plan, "run": cmd_run, "report": cmd_report}[args.command](spec, args)
    except (SpecError, runner.MixedCommits, ManifestError) as error:
        print(f"python -m benchmarks.study {args.command}: {error}", file=sys.stderr)
        return 2
    except Stopped as signal_name:  # (run's loop answers the stops it sees itself)
        print(stopped_line(args.command, str(signal_name)), file=sys.stderr)
        return 75
    except BrokenPipeError:  # `report ... | head`: the reader left; the files are written
        sys.stdout = open(os.devnull, "w")
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    code = main(handle_signals=True)
    for _signum in handled():  # past main: a stop while exiting is not "before any run started"
        signal.signal(_signum, signal.SIG_DFL)
    sys.exit(code)
