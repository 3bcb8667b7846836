"""Command line: ``attnref audit``, ``attnref bench`` and ``attnref demo copy|reverse``
(``python -m attnref ...`` works too)."""

import argparse
import contextlib
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from attnref import __version__, _forkserver
from attnref.conformance.options import add_audit_options

if TYPE_CHECKING:  # imported where used: the command starts without torch
    from attnref.conformance.report import AuditReport

__all__ = ["main"]

#: when `main` began (the start-up's fallback where ``/proc`` is absent)
_MAIN_STARTED = time.perf_counter()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnref",
        description="Reference attention and a conformance suite for attention backends.",
    )
    parser.add_argument("--version", action="version", version=f"attnref {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit",
        help="audit an attention backend against the float64 reference",
        description=(
            "Search for inputs on which a backend breaks a property of attention "
            "(agreement with the float64 oracle, gradients, masking, causality, "
            "GQA, layouts, odd lengths, half precision, ...), shrink every failure to a "
            "minimal case and print a reproducer. Exit code 0 only if nothing failed."
        ),
    )
    a.add_argument(
        "--backend",
        default="torch-sdpa",
        help="a built-in name or mutant.NAME (see --list-backends), or module:function "
        "(default: torch-sdpa)",
    )
    add_audit_options(a.add_argument)
    a.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="judge processes sharing the (property, dtype) searches, each with a worker "
        "of its own; each search is seeded alone, so a backend whose answers depend on its "
        "inputs alone gets the same verdict for any N (default: $ATTNREF_JOBS, else 2 "
        "where the process may use 2 cores or more, else 1)",
    )
    a.add_argument(
        "--json",
        metavar="PATH",
        help="also write the JSON report, and its reproducers to PATH.reproducers/ (where "
        "an earlier run's are removed first)",
    )
    a.add_argument(
        "--junit",
        metavar="PATH",
        help="also write the report as JUnit XML (one testcase per property and dtype), "
        "for a CI's test view",
    )
    a.add_argument(
        "--html",
        metavar="PATH",
        help="also write the report as one self-contained HTML page: the property x "
        "dtype grid, each finding's heatmap and reproducer once (its variations folded), "
        "coverage tables and a plot",
    )
    a.add_argument(
        "--bug-reports",
        metavar="DIR",
        help="also write a bug report a maintainer runs without attnref for each finding "
        "(its inputs, the float64 answer, repro.py, REPORT.md: docs/reports.md)",
    )
    a.add_argument(
        "--shard",
        metavar="K/N",
        help="run shard K of N: every N-th (property, dtype) search from the K-th; the "
        "shards' --json reports merge into the whole audit's (attnref merge)",
    )
    a.add_argument("--fail-fast", action="store_true", help="stop at the first failing property")
    a.add_argument(
        "--list-backends", action="store_true", help="list built-in backends and mutants"
    )
    a.add_argument(
        "--list-properties", action="store_true", help="list the properties and what they target"
    )
    a.add_argument(
        "--list-families", action="store_true", help="list the API families (--api) and signatures"
    )
    a.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (without a terminal: no line every 30 s, which names the "
        "search under way and its cases so far)",
    )
    a.add_argument(
        "--interpreter",
        choices=["triton", "pallas"],
        help="run the backend's kernel through this interpreter on the CPU: set up in its "
        "worker before its module is imported (a module may declare it itself: "
        "Capabilities(interpreter=...); docs/interpreted.md)",
    )
    a.add_argument(
        "--verbose", "-v", action="store_true", help="tracebacks, skip reasons, all reproducers"
    )
    b = sub.add_parser(
        "bench",
        help="benchmark attention backends at the same shapes (time, TFLOP/s, memory)",
        description=(
            "Time every backend on the same shapes: median of timed calls after warm-up, "
            "inputs rotated, CUDA events on a GPU; FLOPs counted for the mask applied; "
            "peak memory; a CSV, a JSON and a plot of TFLOP/s against sequence length. "
            "Also runnable as python -m attnref.bench."
        ),
    )
    from attnref.bench import add_arguments

    add_arguments(b)
    m = sub.add_parser(
        "merge",
        help="merge the --json reports of an audit's shards (--shard K/N) into one",
        description=(
            "Put the shards of one audit back together: the merged report is the one a "
            "single process would have written (each search is seeded alone). Reports of "
            "different backends, declarations, versions, profiles, seeds, dtypes or "
            "devices, and a missing or repeated shard, are refused with the reason. Exit "
            "code 0 only if the merged audit is OK."
        ),
    )
    m.add_argument("reports", nargs="+", metavar="REPORT.json", help="every shard's report")
    m.add_argument("--json", required=True, metavar="PATH", help="the merged report")
    m.add_argument("--junit", metavar="PATH", help="also the merged report as JUnit XML")
    m.add_argument("--html", metavar="PATH", help="also the merged report as an HTML page")
    r = sub.add_parser(
        "report",
        help="print a saved --json report, or write it as JUnit XML",
        description="Read a report written by --json and print its table (and findings).",
    )
    r.add_argument("report", metavar="REPORT.json")
    r.add_argument("--junit", metavar="PATH", help="write it as JUnit XML")
    r.add_argument("--html", metavar="PATH", help="write it as an HTML page")
    r.add_argument(
        "--bug-reports",
        metavar="DIR",
        help="write a bug report for each finding, runnable without attnref (the backend "
        "runs once more per finding, in a fresh worker)",
    )
    r.add_argument("--verbose", "-v", action="store_true", help="skip reasons, all reproducers")
    d = sub.add_parser(
        "demo",
        help="train a small model on the CPU and show what it learned",
        description=(
            "copy: train the encoder-decoder Transformer on the Annotated Transformer's "
            "synthetic copy task until greedy decoding copies every fresh sequence, print "
            "decoded examples and save attention heatmaps (PNG) of the trained model. "
            "reverse: train D2L's GRU encoder-decoder with Bahdanau attention to reverse "
            "sequences and save its alignments."
        ),
    )
    d.add_argument("task", choices=["copy", "reverse"], help="the demo to run")
    d.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="copy: most epochs of 20 batches (default: 40); reverse: hundreds of steps "
        "(default: 6)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the model and data (default: 0)")
    d.add_argument(
        "--out",
        default="attnref-demo",
        metavar="DIR",
        help="folder for the heatmaps (default: ./attnref-demo)",
    )
    d.add_argument("--no-plots", action="store_true", help="do not save heatmaps")
    d.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none when not a terminal)"
    )
    d.add_argument("--verbose", "-v", action="store_true", help="tracebacks on errors")
    return parser


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no heatmaps: they need matplotlib (pip install 'attnref[viz]')", file=sys.stderr)
        return False
    return True


def _demo(args: argparse.Namespace) -> int:
    if args.epochs is not None and args.epochs < 1:
        print(f"attnref demo: --epochs must be >= 1, got {args.epochs}", file=sys.stderr)
        return 2
    return _demo_copy(args) if args.task == "copy" else _demo_reverse(args)


def _demo_reverse(args: argparse.Namespace) -> int:
    from attnref.decoding import greedy_decode_seq2seq
    from attnref.tasks import reverse_batch, train_reverse_task

    steps = 100 * (6 if args.epochs is None else args.epochs)
    print(f"training D2L's Bahdanau encoder-decoder to reverse sequences, {steps} steps")
    result = train_reverse_task(
        steps=steps, seed=args.seed, progress=False if args.no_progress else None
    )
    print(
        f"{result.steps} steps, {result.seconds:.1f} s, loss {result.losses[0]:.3f} -> "
        f"{result.losses[-1]:.3f}: greedy decoding reverses {result.accuracy:.1%} of 200 "
        "fresh sequences exactly"
    )
    import torch

    src, lens, _ = reverse_batch(3, generator=torch.Generator().manual_seed(args.seed + 2))
    out, weights = greedy_decode_seq2seq(result.model, src, lens, src.shape[1] + 2, 1)
    for b in range(3):
        n = int(lens[b])
        print(f"  source  {src[b, :n].tolist()}\n  decoded {out[b, 1 : n + 1].tolist()}")
    if not args.no_plots and _have_matplotlib():
        from attnref.viz import plot_alignment

        n = int(lens[0])
        path = plot_alignment(
            weights[0, : n + 1, :n],
            os.path.join(args.out, "bahdanau-alignment.png"),
            xlabels=[str(t) for t in src[0, :n].tolist()],
            ylabels=[str(t) for t in out[0, 1 : n + 2].tolist()],
        )
        print(f"alignment saved to {path}")
    return 0 if result.accuracy >= 0.99 else 1


def _demo_copy(args: argparse.Namespace) -> int:
    from attnref.decoding import greedy_decode
    from attnref.tasks import copy_batches, train_copy_task

    print("training the copy task (vocabulary 11, sequences of 10, 2 layers, H=64) on the CPU")
    result = train_copy_task(
        max_epochs=40 if args.epochs is None else args.epochs,
        seed=args.seed,
        progress=False if args.no_progress else None,
        log=print,
    )
    print(
        f"{result.epochs} epochs, {result.state.step} batches, {result.seconds:.1f} s: "
        f"greedy decoding copies {result.accuracy:.1%} of 200 fresh sequences exactly"
    )
    import torch

    fresh = next(copy_batches(11, 3, 1, generator=torch.Generator().manual_seed(args.seed + 2)))
    decoded = greedy_decode(result.model, fresh.src, fresh.src_mask, fresh.src.shape[1], 1)
    for src, out in zip(fresh.src.tolist(), decoded.tolist(), strict=True):
        mark = "ok" if src == out else "WRONG"
        print(f"  source  {src}\n  decoded {out}  {mark}")
    if not args.no_plots and _have_matplotlib():
        from attnref.viz import save_transformer_heatmaps

        paths = save_transformer_heatmaps(result.model, fresh.src, fresh.tgt, args.out)
        print(f"{len(paths)} heatmaps saved to {args.out}/: {', '.join(p.name for p in paths)}")
    return 0 if result.accuracy >= 1.0 else 1


def _list_backends() -> None:
    from attnref.conformance import BUILTIN_BACKENDS
    from attnref.conformance.families import MUTANTS

    for name, b in BUILTIN_BACKENDS.items():
        print(f"{name:<32} {b.api:<13} {b.description}")
    print()
    for name, m in MUTANTS.items():
        print(f"{'mutant.' + name:<32} {m.api:<13} class {m.bug_class:>2}: {m.summary}")


def _list_families() -> None:
    from attnref.conformance.families import FAMILIES

    for name, f in FAMILIES.items():
        print(f"{name:<15} {f.summary}")
        print(f"{'':<15} {f.signature}")


def _list_properties() -> None:
    from attnref.conformance import PROPERTIES

    for p in PROPERTIES.values():
        classes = ",".join(str(c) for c in p.classes)
        print(f"{p.id:<18} classes {classes:<22} {p.summary}")


def _audit(args: argparse.Namespace) -> int:
    from attnref.conformance import AuditReport, BackendError, audit
    from attnref.conformance.declarations import DEFAULT_API
    from attnref.conformance.family import get_family
    from attnref.conformance.options import OptionError, audit_settings
    from attnref.conformance.report import sandbox_line

    if args.list_backends:
        _list_backends()
        return 0
    if args.list_properties:
        _list_properties()
        return 0
    if args.list_families:
        _list_families()
        return 0
    # the workers' forkserver: started by main, else on the first worker's start
    from attnref.conformance.worker import start_executor

    try:
        settings = audit_settings(lambda dest: getattr(args, dest))
        jobs = _jobs(args.jobs)
        json_path = _writable(args.json)
        junit_path = _writable(args.junit, "--junit")
        html_path = _writable(args.html, "--html")
        shard = None
        if args.shard is not None:
            from attnref.conformance.exports import shard_of

            try:
                shard = shard_of(args.shard)
            except ValueError as e:
                raise OptionError(f"--shard: {e}") from None
        serve = get_family(settings.api or DEFAULT_API).serve
        if serve is not None:  # a process a launcher started, which may not be the judge
            code = serve(
                args.backend, threads=settings.threads, memory_limit=settings.memory_limit_bytes
            )
            if code is not None:
                return int(code)
        if args.interpreter:  # read by every worker this audit starts, helpers' too
            from attnref.interpreted import INTERPRETER_VARIABLE

            os.environ[INTERPRETER_VARIABLE] = args.interpreter
        # the backend's module is imported in its worker only (unless --in-process)
        executor = start_executor(
            args.backend,
            settings.api,
            isolate=settings.isolate,
            threads=settings.threads,
            memory_limit=settings.memory_limit_bytes,
            world_size=settings.world_size,
            require_sandbox=settings.require_sandbox,
        )
        backend = executor.backend
        if args.jobs is None and not getattr(executor, "from_spec", False):
            jobs = 1  # the default where searches cannot be shared: no note for it
    except (BackendError, OptionError) as e:
        print(f"attnref audit: {e}", file=sys.stderr)
        return 2
    print(sandbox_line(executor.sandbox), flush=True)  # the first line: what confines it
    report = AuditReport.start(
        backend.name,
        settings.device,
        [str(d) for d in settings.dtypes or backend.capabilities.dtypes],
        settings.profile.name,
        settings.seed,
        backend.capabilities,
        backend.api,
        startup=_process_age(),
    )

    quiet = args.no_progress
    bar = not quiet and sys.stderr.isatty()
    # no terminal for a bar (a CI log, a pipe): a line every PROGRESS_EVERY seconds
    # instead, within a search too (an interpreted kernel's can take minutes)
    ticker = _Ticker(report, every=PROGRESS_EVERY, on=not bar and not quiet)

    def save(partial: AuditReport) -> None:  # after every property: a crash loses nothing
        ticker.current = ""  # the search it named has ended
        if len(partial.results) in _checkpoints(partial.planned):
            ticker.say(_estimate(partial))
        if json_path is None:
            return
        reason = partial.incomplete
        # until the final write, the file says the audit had not finished
        partial.incomplete = reason or "the audit had not finished when this was written"
        try:
            partial.write_json(json_path)
        finally:
            partial.incomplete = reason

    try:
        ticker.start()
        audit(
            backend,
            **settings.audit_kwargs(),
            executor=executor,
            fail_fast=args.fail_fast,
            progress=bar,
            on_result=save,
            report=report,
            jobs=jobs,
            shard=shard,
            on_case=ticker.case,
        )
    except KeyboardInterrupt as e:
        executor.close()
        where = f"; the partial report is in {json_path}" if json_path else ""
        how = "terminated by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        print(f"attnref audit: {how}{where}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        ticker.stop()
        executor.close()  # no backend code runs while the final report is written
    print(report.format_table(verbose=args.verbose))
    if json_path is not None:
        written = report.write_json(json_path)
        print(f"report written to {json_path}")
        if len(written) > 1:
            print(f"reproducers written to {written[1].parent}/")
    if junit_path is not None:
        from attnref.conformance.exports import write_junit

        write_junit(report, junit_path)
        print(f"JUnit XML written to {junit_path}")
    if html_path is not None:
        from attnref.conformance.html import write_html

        write_html(report, html_path)
        print(f"HTML report written to {html_path}")
    if args.bug_reports:
        _bug_reports(report, Path(args.bug_reports))
    return 0 if report.ok else 1


def _bug_reports(report: "AuditReport", folder: Path) -> None:
    """``--bug-reports``: a folder per finding (`attnref.conformance.bugreports`)."""
    from attnref.conformance.bugreports import write_bug_reports

    written = write_bug_reports(report, folder)
    print(f"{len(written)} bug reports written to {folder}/ (repro.py runs without attnref)")


def _saved(args: argparse.Namespace) -> int:
    """``attnref merge`` and ``attnref report``: saved reports read back and written
    again (docs/reports.md)."""
    from attnref.conformance.exports import MergeError, load_report, merge_reports, write_junit
    from attnref.conformance.options import OptionError

    paths = args.reports if args.command == "merge" else [args.report]
    try:  # the outputs first: nothing is read for a page that cannot be written
        for option in ("--json", "--junit", "--html"):
            _writable(getattr(args, option[2:], None), option)
    except OptionError as e:
        print(f"attnref {args.command}: {e}", file=sys.stderr)
        return 2
    try:
        reports = [load_report(p) for p in paths]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"attnref {args.command}: cannot read a report: {e}", file=sys.stderr)
        return 2
    if args.command == "merge":
        try:
            report = merge_reports(reports, [str(p) for p in paths])
        except MergeError as e:
            print(f"attnref merge: {e}", file=sys.stderr)
            return 2
        report.write_json(args.json)
        print(f"merged {len(paths)} shards into {args.json}")
    else:
        (report,) = reports
    print(report.format_table(verbose=getattr(args, "verbose", False)))
    if args.junit:
        write_junit(report, args.junit)
        print(f"JUnit XML written to {args.junit}")
    if args.html:
        from attnref.conformance.html import write_html

        write_html(report, args.html)
        print(f"HTML report written to {args.html}")
    if getattr(args, "bug_reports", None):
        _bug_reports(report, Path(args.bug_reports))
    return 0 if report.ok else 1


def _process_age() -> float:
    """Seconds since this process started (from Linux's ``/proc``; else since `main`):
    the start-up the audit's own clock does not see."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _MAIN_STARTED


def _checkpoints(planned: int) -> set[int]:
    """After how many finished searches the estimate is said: three (the first alone is
    the slowest, `forward`), then a tenth (where a user decides whether to wait), a
    quarter, a half and three quarters of them."""
    marks = (3, planned // 10, planned // 4, planned // 2, 3 * planned // 4)
    return {n for n in marks if 3 <= n < planned}


#: seconds between two progress lines of an audit printed without a terminal
PROGRESS_EVERY = 30.0


def _progress(report: "AuditReport", seconds: float, current: str = "") -> str:
    """One line on an audit under way, for a log with no terminal to draw a bar on
    (``seconds``: since it began; ``current``: the search under way, and how far)."""
    failed = report.count("fail")
    now = f"; {current}" if current else ""
    return (
        f"attnref audit: {len(report.results)} of {report.planned} (property, dtype) "
        f"searches done, {failed} failed, {seconds / 60:.1f} min so far{now}"
    )


class _Ticker(threading.Thread):
    """Says how an audit goes every ``every`` seconds that nothing else was said, from
    a thread of its own: after each search, and within one (the judge's own search:
    its cases so far), so that a log never goes silent for minutes. ``on=False``
    prints only what `say` is given (the estimates)."""

    def __init__(self, report: "AuditReport", *, every: float, on: bool) -> None:
        super().__init__(name="attnref-progress", daemon=True)
        self.report, self.every, self.on = report, every, on
        self.began = self.said = time.perf_counter()
        self.current = ""
        self.ended = threading.Event()
        self.lock = threading.Lock()

    def case(self, search: str, cases: int, seconds: float) -> None:
        """`attnref.conformance.runner.audit`'s ``on_case``."""
        self.current = f"{search}: {cases} cases checked in {seconds:.0f} s"

    def say(self, line: str) -> None:
        with self.lock:
            print(line, file=sys.stderr, flush=True)
            self.said = time.perf_counter()

    def run(self) -> None:
        if not self.on:
            return
        if hasattr(signal, "pthread_sigmask"):  # Ctrl-C and SIGTERM go to the main thread
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while not self.ended.wait(min(1.0, self.every)):
            now = time.perf_counter()
            if now - self.said >= self.every:
                self.say(_progress(self.report, now - self.began, self.current))

    def stop(self) -> None:
        self.ended.set()
        if self.is_alive():
            self.join()


def _estimate(report: "AuditReport") -> str:
    """How long the rest of the audit will take, from the searches finished so far."""
    seconds = [r.seconds for r in report.results]
    return "attnref audit: " + estimate(seconds, report.planned, report.judges)


def estimate(seconds: list[float], planned: int, judges: int) -> str:
    """The time left for ``planned`` searches shared by ``judges``, from the ``seconds``
    the finished ones took: their median a search, within the range their lower quartile
    and their mean make, and how many it rests on. The first search (``forward``, the
    widest) took 2-5 times the others: extrapolated alone, it said 4.0 min where the
    audit took 63 s."""
    done, left = len(seconds), max(0, planned - len(seconds))
    ordered = sorted(seconds)
    median = statistics.median(ordered)
    # the range holds its point: the mean lies below the median where a few searches
    # were quick ("about 8.2 min left (4.0 min to 7.2 min)")
    low = min(median, ordered[(done - 1) // 4])
    high = max(median, statistics.fmean(ordered))

    def span(x: float) -> str:
        t = x * left / max(1, judges)
        if t < 1:
            return "under 1 s"  # not "about 0 s"
        return f"{t / 60:.1f} min" if t >= 90 else f"{t:.0f} s"

    sure = "a rough guess" if done < 10 else "fairly sure" if done < planned // 2 else "sure"
    point, lo, hi = span(median), span(low), span(high)
    about = point if point.startswith("under") else f"about {point}"
    between = "" if lo == hi else f"{lo} to {hi}; "
    return (
        f"{done} of {planned} (property, dtype) searches done; {about} left "
        f"({between}{sure}, from {done} searches; --deadline and --property-budget bound it)"
    )


def _jobs(asked: int | None) -> int:
    """``--jobs``, or its default: ``ATTNREF_JOBS``, else 2 where this process may run on
    2 cores or more (the judge keeps one busy), else 1.

    Raises:
        OptionError: fewer than one job.
    """
    from attnref.conformance.options import OptionError

    if asked is None:
        env = os.environ.get("ATTNREF_JOBS", "").strip()
        if env:
            try:
                asked = int(env)
            except ValueError:
                raise OptionError(f"ATTNREF_JOBS must be a whole number, got {env!r}") from None
        else:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            asked = min(2, cpus or os.cpu_count() or 1)
    if asked < 1:
        raise OptionError(f"--jobs must be >= 1, got {asked}")
    return asked


def _writable(path: str | None, option: str = "--json") -> Path | None:
    """``path`` as a ``Path`` if a report can be written there, before the audit runs;
    ``option`` names it in the error. An HTML page needs matplotlib too: an audit of
    many minutes that cannot write its page at the end is told so at the start.

    Raises:
        OptionError: its folder does not exist or cannot be written, or it is a folder;
            or (``--html``) matplotlib is not installed.
    """
    import importlib.util

    from attnref.conformance.options import OptionError

    if path is None:
        return None
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise OptionError(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise OptionError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise OptionError(f"{option} {path}: the folder {folder} cannot be written")
    if option == "--html" and importlib.util.find_spec("matplotlib") is None:
        raise OptionError(
            f"{option} {path}: the HTML report draws with matplotlib, which is not installed "
            "(pip install 'attnref[viz]')"
        )
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI step's timeout, ``kill``), raised in the main thread: the run then
    ends as after Ctrl-C (workers stopped, their scratch folders removed, the partial
    report written and marked incomplete), and exits 143."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _sigterm_ends_cleanly() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnref`` command; returns the exit code."""
    global _MAIN_STARTED
    _MAIN_STARTED = time.perf_counter()
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] in (["audit"], ["bench"]) and not {"-h", "--help"} & set(raw):
        # before torch is imported here: the workers' parent imports it meanwhile
        _forkserver.start()
    args = _parser().parse_args(argv)
    if not sys.stdout.isatty():  # CI logs and pipes see each line as it is printed
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    try:
        with _sigterm_ends_cleanly():
            if args.command == "audit":
                return _audit(args)
            if args.command == "demo":
                return _demo(args)
            if args.command in ("merge", "report"):
                return _saved(args)
            if args.command == "bench":
                from attnref.bench import run_cli

                return run_cli(args)
    except Terminated:
        print(f"attnref {args.command}: terminated by SIGTERM", file=sys.stderr)
        return 143
    except Exception as e:  # an internal error: one line unless --verbose
        if getattr(args, "verbose", False):
            traceback.print_exc()
        else:
            print(
                f"attnref: internal error: {type(e).__name__}: {e} "
                "(run with --verbose for the traceback)",
                file=sys.stderr,
            )
        return 3
    return 2


if __name__ == "__main__":
    sys.exit(main())
