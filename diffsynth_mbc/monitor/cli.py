"""Watch a training run from its per-rank files: a live terminal view, a JSON probe, a dashboard server.

    python -m diffsynth_mbc.monitor [LOG_DIR|URL ...] [--once] [--json] [--interval S]
                                    [--stall_after S] [--serve [HOST:]PORT] [--no_view] [--cors ORIGIN]
                                    [--allow_host NAME ...]

LOG_DIR (default ./training_logs) holds ``training_gpu{rank}.json`` (state) and
``training_gpu{rank}.jsonl`` (one line per optimizer step) written by every rank. It must exist
(else exit 2); a folder whose run's logs are one level down (a run's output folder holding
training_logs/) is followed to them, saying so. Several sources (folders, and other monitors'
--serve URLs, e.g. one per node when log folders are node-local) are shown as one run with
every rank.

Modes
    default        live view, refreshed every --interval seconds; Ctrl-C quits (exit 0).
    --once         draw one frame and exit with the run's exit code.
    --json         print the aggregate as one JSON object and exit with the run's exit code.
    --serve ADDR   serve the dashboard and /api/training/{status,metrics} over HTTP (127.0.0.1
                   unless a host is given; port 0 picks a free one; the URL is printed). The
                   live view runs beside it when stdout is a terminal, unless --no_view.
                   Ctrl-C (or SIGTERM) stops both. Requests naming another host than
                   loopback, the bound one (or --allow_host) get 421. Bound to anything but
                   loopback (e.g. 0.0.0.0:7010 for other nodes), the server wants a token on
                   every request: it is printed once, in the URL (http://HOST:PORT/?token=...);
                   give that URL to the browser or to another monitor as a source.

Exit codes (--once / --json)
    0 starting, loading, training, finished, stopped (a stop was asked for, it is no error), preempted
    (the scheduler ended the job; a requeued job goes on from its checkpoint);
    1 failed; 3 stalled; 4 no data (no status file); 2 usage error.

Run status, first rule that matches
    no_data > failed (any rank failed) > stalled (any active rank's updated_at older than the
    stall threshold) > finished (all present ranks finished) > preempted (none active, one
    preempted) > stopped (none active, one stopped) > training / loading / starting (most
    advanced active status).

Stall threshold
    --stall_after S when given, else max(120 s, 10 x the rank's median step time). A rank waiting
    in a collective for the others keeps its file fresh and says what it waits for, so a hung
    rank is the only one called stalled.

Several runs in one directory
    The run_id with the newest started_at is shown; files of other runs are ignored and
    named in the notes. Ranks below world_size without a file are listed as missing (they do
    not change the run status: on several nodes without a shared directory they always are).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.monitor.sources import split_sources
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.status import exit_code
from diffsynth_mbc.run_layout import DEFAULT_LOGS_FOLDER, STATUS_FILE_GLOB

DEFAULT_LOG_DIR = f"./{DEFAULT_LOGS_FOLDER}"


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    paragraphs = __doc__.split("\n\n")
    parser = FlagParser(
        allow_abbrev=False,
        prog="python -m diffsynth_mbc.monitor",
        description=paragraphs[0],
        epilog="\n\n".join(paragraphs[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sources", nargs="*", default=[DEFAULT_LOG_DIR], metavar="LOG_DIR_OR_URL",
                        help=f"folders with {STATUS_FILE_GLOB}[l] (default {DEFAULT_LOG_DIR}) and/or other monitors' "
                             "--serve URLs (http://HOST:PORT), e.g. one per node when log folders are node-local: "
                             "shown as one run")
    parser.add_argument("--once", action="store_true", help="draw one frame and exit with the run's exit code")
    parser.add_argument("--json", action="store_true", help="print the aggregate as JSON and exit (implies --once)")
    parser.add_argument("--interval", type=_positive, default=2.0, metavar="S",
                        help="seconds between refreshes of the live view (default 2)")
    parser.add_argument("--stall-after", type=_positive, default=None, metavar="S",
                        help="a rank silent this long while active is STALLED "
                             "(default: max(120, 10 x its median step time))")
    parser.add_argument("--serve", metavar="[HOST:]PORT", default=None,
                        help="serve the dashboard and the JSON API (host 127.0.0.1 unless given; port 0 = any)")
    parser.add_argument("--no-view", action="store_true", help="with --serve: no live view, serve only")
    parser.add_argument("--cors", metavar="ORIGIN", default=None,
                        help="with --serve: let web pages of ORIGIN (e.g. http://localhost:3000) read the API; "
                             "by default no other page can")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="with --serve: also answer requests for this host name (e.g. a DNS alias of this "
                             "node); loopback names and the bound host are always answered")
    return parser


def _console():
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=150)


class _Stop(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Stop()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    serve_addr = None
    if args.allow_host and args.serve is None:
        parser.error("--allow_host needs --serve")
    if args.serve is not None:
        if args.once or args.json:
            parser.error("--serve cannot be combined with --once or --json")
        from diffsynth_mbc.monitor.access import parse_serve

        try:
            serve_addr = parse_serve(args.serve)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        folders, remotes = split_sources(args.sources)
    except ValueError as exc:
        parser.error(str(exc))
    from diffsynth_mbc.monitor.sources import follow_folder

    try:
        followed = [follow_folder(folder) for folder in folders]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folders = [folder for folder, _ in followed]
    for _, note in followed:
        if note:
            print(note, file=sys.stderr, flush=True)
    log_dir = " + ".join([str(f) for f in folders] + [str(r) for r in remotes])
    state = MonitorState(folders, remotes=remotes, stall_after=args.stall_after,
                         backfill=not (args.once or args.json))   # one answer: no whole reads behind it

    if args.json:
        snap = state.refresh()
        sys.stdout.write(json.dumps(snap, indent=2, allow_nan=False) + "\n")
        sys.stdout.flush()
        return exit_code(snap["status"])
    if args.once:
        from diffsynth_mbc.monitor.view import render

        snap = state.refresh()
        console = _console()
        console.print(render(snap, log_dir=str(log_dir), width=console.width))
        return exit_code(snap["status"])

    server = None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if serve_addr is not None:
            from diffsynth_mbc.monitor.server import MonitorServer

            try:
                server = MonitorServer(state, *serve_addr, cors_origin=args.cors, allow_hosts=args.allow_host).start()
            except OSError as exc:
                print(f"cannot serve on {args.serve}: {exc}", file=sys.stderr)
                return 2
            if server.token:
                print(f"warning: {args.serve} is reachable from other machines, without encryption; every request "
                      "must carry the token in the URL below (keep it private; 127.0.0.1 with ssh -L is safer)",
                      file=sys.stderr, flush=True)
            print(f"Serving the training dashboard at {server.url} (log dir {log_dir})", flush=True)
        if server is not None and (args.no_view or not sys.stdout.isatty()):
            while True:
                time.sleep(3600)
        _live(state, log_dir, args.interval, server.address if server else None)
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        if server is not None:
            server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _live(state: MonitorState, log_dir: str, interval: float, url: str | None) -> None:
    from rich.live import Live

    from diffsynth_mbc.monitor.view import render

    console = _console()
    served = f" · dashboard {url}" if url else ""
    # Ctrl-C ends the loop between two refreshes rather than as an exception inside a read or a render, so the
    # display is always stopped whole (cursor shown again) however loaded the machine is.
    quit_requested = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: quit_requested.set())
    try:
        with Live(console=console, auto_refresh=False, transient=False, redirect_stderr=False) as live:
            while not quit_requested.is_set():
                tick = time.monotonic()
                snap = state.refresh()
                footer = (f"refreshed {time.strftime('%H:%M:%S')} in {snap['refresh_ms']:.0f} ms · every "
                          f"{interval:g}s{served} · Ctrl-C to quit")
                live.update(render(snap, log_dir=str(log_dir), footer=footer, width=live.console.width),
                            refresh=True)
                quit_requested.wait(max(0.05, interval - (time.monotonic() - tick)))
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    raise SystemExit(main())
