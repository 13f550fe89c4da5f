"""``python -m diffsynth_mbc.doctor [--config PRESET] [training flags] [--assume GPU] [--json] [--quick] [--probe N]``.

Answers "will this run work, how fast will it go and how long will it take" before a long job: GPUs and
torch kernels, precision and attention kernel, NCCL, /dev/shm, open files, disks, model files, metadata,
ffmpeg, the memory per GPU itemised against the GPU's memory (with the cheapest change that makes it
fit), seconds per step from step times measured on an H100 (scaled to the GPU), and the run's
projected length. ``--probe N`` measures instead: N real optimizer steps of this run on this machine.
Exit codes: 0 nothing failed (warnings allowed), 1 a check failed (or the probe), 2 usage.
"""

from __future__ import annotations

import contextlib
import json
import sys

from diffsynth_mbc.doctor import checks, disk
from diffsynth_mbc.doctor.checks import FAIL, GIB, Check
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.training.options import build_parser as training_parser
from diffsynth_mbc.training.plan import estimates, memory


def build_parser():
    parser = FlagParser(prog="python -m diffsynth_mbc.doctor", add_help=False, passes_on_to=training_parser,
                        description=__doc__.split("\n\n")[1])
    parser.add_argument("--assume", help="plan for a GPU that is not here: " + ", ".join(checks_known_gpus()))
    parser.add_argument("--gpus", type=int, help="GPUs per node (default: those found; with --assume, the processes "
                                                 "per node of the launchers' configs/accelerate settings)")
    parser.add_argument("--nodes", type=int, help="nodes of the run (default: NUM_MACHINES, else 1)")
    parser.add_argument("--cached", action="store_true",
                        help="the run builds the latent cache first and trains from it (the launchers' --cached)")
    parser.add_argument("--deepspeed", action="store_true", help="the plan uses DeepSpeed ZeRO-2")
    parser.add_argument("--probe", type=int, metavar="N",
                        help="also run N real optimizer steps of this run on this machine (clips and images apart; "
                             "with --buckets aspect every bucket in use apart; in a temporary folder) and project the "
                             "run's length from the measured step times")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true",
                        help="skip the slow checks (NCCL bandwidth, decoding rows); the launchers run this")
    parser.add_argument("--brief", action="store_true",
                        help="one summary line, plus a line for each warning or failure (the launchers use this)")
    parser.add_argument("--detail-file", metavar="FILE",
                        help="with --brief: every check's line goes to FILE (appended; the launchers pass the run's "
                             "log) and only the failures to the terminal")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def parse(argv):
    parser = build_parser()
    ours, training_argv = parser.parse_known_args(argv)
    if ours.help:
        parser.print_help()
        print("\nEvery other flag is a training flag (python -m diffsynth_mbc.train --help), e.g. --config.")
        raise SystemExit(0)
    if ours.probe is not None and ours.probe < 1:
        raise OptionsError(f"--probe must be a positive number of steps, got {ours.probe}")
    if ours.probe and ours.assume:
        raise OptionsError("--probe measures this machine; leave out --assume")
    from diffsynth_mbc.training.options import resolve_options

    return ours, resolve_options(training_argv)


def checks_known_gpus():
    from diffsynth_mbc.gpu import KNOWN_GPUS

    return list(KNOWN_GPUS)


def estimate_run(options, ours, target: checks.Target, precision: str, media) -> tuple[list, dict, dict, list]:
    """The memory and speed checks with the memory's detail, the speed and projection, and the assumptions."""
    from diffsynth_mbc.doctor.advice import speed_check
    from diffsynth_mbc.gpu import attention_kernel

    spec = target.spec

    def estimate(these, plan=None):
        return estimates.estimate_run(these, spec, target.rates_from, precision, cudnn_version=target.cudnn_version,
                                      gpus=target.count, nodes=ours.nodes, cached_launch=ours.cached, media=media,
                                      zero2_world_size=target.count if ours.deepspeed else 1, plan=plan)

    run = estimate(options)
    if spec is None:
        return [Check("memory", checks.SKIP, "no GPU: use --assume NAME to plan for one")], {}, run.speed, []
    assumptions = run.assumptions + [f"CUDA context {memory.CUDA_CONTEXT_BYTES / GIB:.1f} GiB; 'fits' = under "
                                     f"{memory.FITS_BELOW:.0%} of the GPU"] + target.assumptions
    gpu_bytes = int(spec.memory_gib * GIB)
    report = estimates.memory_summary(run.plans, gpu_bytes, run.buckets)
    largest = run.plans[report["batch"]]
    changes = memory.changes_that_fit(largest, gpu_bytes, spec.native_bf16,
                                      lambda p: attention_kernel(spec.capability, p, target.cudnn_version))
    report["changes_that_fit"] = [{"flags": flags, "precision": p.precision, "cached": p.cached,
                                   "total_bytes": memory.total(memory.estimate(p))} for flags, p in changes]
    sized = f"{report['bucket_note']}, " if report.get("bucket_note") else ""
    detail = (f"{report['total_bytes'] / GIB:.1f} GiB estimated ({report['batch']} batch, {sized}"
              f"{largest.recomputed_blocks} of 30 blocks recomputed) of {spec.memory_gib:.0f} GiB on {spec.name}")
    # the candidates change no option of the step plan: theirs is this run's (its buckets read once)
    candidate = (lambda these: estimate(these, run.step_plan)) if run.buckets else estimate
    speed = [c for c in (speed_check(options, run, candidate, gpu_bytes),) if c is not None]
    if report["fits"]:
        return [Check("memory", checks.OK, detail + " (fits)"), *speed], report, run.speed, assumptions
    fix = (f"{changes[0][0]} (at {changes[0][1].precision}) -> "
           f"{report['changes_that_fit'][0]['total_bytes'] / GIB:.1f} GiB") if changes else \
        "no single change or pair fits: lower --height/--width/--num_frames"
    return [Check("memory", FAIL, detail + " (does not fit)", fix), *speed], report, run.speed, assumptions


def run_checks(ours, options) -> dict:
    target = checks.find_target(ours.assume, ours.gpus, ours.deepspeed)
    precision_check, precision = checks.precision_check(target, options.mixed_precision)
    metadata_check, media = checks.metadata_check(options, ours.quick)
    found = [checks.gpu_check(target), checks.arch_check(target), precision_check,
             checks.nccl_check(target, ours.quick), checks.shm_check(options), checks.open_files_check(),
             *disk.disk_checks(options, media, ours.cached), checks.model_check(options), metadata_check,
             checks.frame_rate_check(options, media), checks.ffmpeg_check(options)]
    estimated, memory_detail, speed, assumptions = estimate_run(options, ours, target, precision, media)
    found += estimated
    exit_code = 1 if any(c.status == FAIL for c in found) else 0
    return {"exit_code": exit_code, "gpu": None if target.spec is None else {
                "name": target.spec.name, "capability": list(target.spec.capability), "count": target.count,
                "memory_gib": round(target.spec.memory_gib, 1), "native_bf16": target.spec.native_bf16,
                "assumed": target.assumed, "rates_from": target.rates_from},
            "checks": [vars(c) for c in found], "memory": memory_detail, "speed": speed,
            "assumptions": assumptions, "media": None if media is None else {"videos": media[0], "images": media[1]}}


def main(argv: list[str] | None = None) -> int:
    from diffsynth_mbc.gpu import quiet_torch_notices

    quiet_torch_notices()
    try:
        ours, options = parse(argv)
    except (OptionsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with contextlib.redirect_stdout(sys.stderr):   # libraries' notices must not end up inside --json
            result = run_checks(ours, options)
            if ours.probe:
                from diffsynth_mbc.doctor.step_probe import probe_report

                result["probe"] = probe_report(ours, options, result)
                if result["probe"].get("error"):
                    result["exit_code"] = 1
    except ValueError as exc:   # an unknown --assume name
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from diffsynth_mbc.doctor import report

    if ours.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif ours.brief:
        try:
            report.print_brief(result, ours.detail_file)
        except OSError as exc:
            print(f"error: --detail_file {ours.detail_file}: {exc.strerror}", file=sys.stderr)
            return 2
    else:
        report.print_table(result)
    return result["exit_code"]
