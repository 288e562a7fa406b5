"""python -m benchmarks <experiment> [options]   (see --help)"""

import argparse
import shlex
import sys

from benchmarks.experiment_names import NAMES, OWN_MODELS
from benchmarks.harness import extra, link_configs
from benchmarks.harness.options import BenchOptions, device_problem, quick_lengths
from benchmarks.harness.round_robin import RoundRobinUnavailable
from benchmarks.workloads.presets import MODELS, PRESETS

QUICK_SOAK_ITERATIONS = 100
# The experiments --backend ddp_ext_mpi applies to.
BACKEND_EXPERIMENTS = ("allreduce", "compare")
# The experiments --link applies to (scaleout shapes its own links).
LINK_EXPERIMENTS = ("overlap", "sharding")


def _link_gbit(text: str) -> float:
    """--link's rate: "1gbit", "10gbit", "2.5gbit" -> Gbit/s."""
    try:
        return link_configs.rate_gbit(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _configs(text: str) -> tuple:
    """--configs: the configurations' names, each spelled once."""
    try:
        return tuple(config.name for config in link_configs.parse(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    defaults = BenchOptions(experiment="")
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of ddp_ext against torch's DDP, after section 5 of the PyTorch Distributed "
                    "paper. Starts its own ranks over Gloo and writes OUT/<experiment>.json (the summary), .png (the "
                    "figure) and .samples.json.gz (every measured iteration). `all` runs every experiment; "
                    "`report` generates docs/BENCHMARKS.md and its pages (docs/benchmarks/) from benchmarks/results/text/*.md and the summaries in "
                    "--out (default there: benchmarks/results). "
                    f"Needs the `bench` extra: {extra.INSTALL_COMMAND}.",
    )
    p.add_argument("experiment", choices=[*NAMES, "all", "report"])
    p.add_argument("--preset", choices=PRESETS, default=defaults.preset)
    p.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks per run (default 2)")
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=None,
                   help="bucket cap(s) in MiB for both DDPs; default: each DDP's own default "
                        "(bucket: 0 1 5 10 25 50 100, where 0 means one parameter per bucket)")
    own = sorted({m for models in OWN_MODELS.values() for m in models})
    p.add_argument("--models", nargs="+", choices=[*MODELS, *own], default=None,
                   help="default: both (nosync: resnet50, as in the paper; order: " + ", ".join(OWN_MODELS["order"])
                        + ", which only it trains)")
    p.add_argument("--out", default=None,
                   help=f"output directory (default {defaults.out}; report: the summaries to read, default "
                        "benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix for the output names, e.g. ws1 -> compare-ws1.json")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank (default 1)")
    lengths = "; fewer for the longer experiments, see their RUN_LENGTHS"
    p.add_argument("--warmup", type=int, default=None, help=f"default {defaults.warmup}{lengths}")
    p.add_argument("--blocks", type=int, default=None, help=f"default {defaults.blocks}{lengths}")
    p.add_argument("--block-iterations", type=int, default=None,
                   help=f"default {defaults.block_iterations}{lengths}")
    p.add_argument("--discard-per-block", type=int, default=None, help=f"default {defaults.discard_per_block}")
    p.add_argument("--hang-watch-cost", action="store_true",
                   help="compare: also measure ddp_ext with hang attribution off (hang_timeout_s=0), interleaved")
    p.add_argument("--auto", action="store_true",
                   help='bucket: also measure bucket_cap_mb="auto", interleaved with ddp_ext at every fixed cap')
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(defaults.world_sizes), help="scale")
    p.add_argument("--sync-every", type=int, nargs="+", default=list(defaults.sync_every), help="nosync")
    p.add_argument("--rr-groups", type=int, nargs="+", default=list(defaults.rr_groups),
                   help="round-robin group counts (roundrobin, allreduce)")
    p.add_argument("--no-round-robin", action="store_true", help="allreduce: measure the Gloo group only")
    p.add_argument("--convergence-iterations", type=int, default=0, help="nosync; 0: the preset's default")
    p.add_argument("--allreduce-elements", type=int, default=0, help="allreduce; 0: the preset's default")
    p.add_argument("--soak-iterations", type=int, default=None,
                   help=f"faults: iterations of the memory soak (default {defaults.soak_iterations}; --quick: "
                        f"{QUICK_SOAK_ITERATIONS})")
    p.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds per launch of ranks")
    p.add_argument("--quick", action="store_true",
                   help="tiny run lengths to check that an experiment works end to end (not a measurement)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device,
                   help="compare: where models and batches live (cuda: cuda:(rank %% GPUs); default cpu)")
    p.add_argument("--backend", choices=["gloo", "nccl", "ddp_ext_mpi"], default=None,
                   help="the ranks' process-group backend (default gloo; nccl with --device cuda); "
                        "ddp_ext_mpi (allreduce and compare) starts the ranks with mpirun")
    p.add_argument("--link", type=_link_gbit, default=None,
                   help="overlap: each rank a host of its own (a network namespace, needs root) whose link "
                        "sends at this rate, e.g. 1gbit or 10gbit (default: all ranks on the loopback)")
    p.add_argument("--hosts", type=int, default=None,
                   help="overlap with --link: how many hosts (default: one per rank); the run has "
                        "hosts x ranks-per-host ranks, whatever --world-size says")
    p.add_argument("--ranks-per-host", type=int, default=None,
                   help="overlap with --link: ranks on each host, talking over its loopback (default 1)")
    p.add_argument("--configs", type=_configs, default=(),
                   help="overlap: run these configurations in turn and write one result holding them all: "
                        f"comma-separated, each {link_configs.SPELLING} (the loopback at --world-size ranks); "
                        f"`all`: {','.join(link_configs.ALL)}. Not with --link, --hosts or --ranks-per-host")
    p.add_argument("--steps", type=int, default=0,
                   help="diloco: steps of torch's DDP; the other variants run 1.5 times as many (default 500)")
    p.add_argument("--doc", default=None, help="report: the document to write (default docs/BENCHMARKS.md), its pages in the folder benchmarks/ beside it")
    return p


def _placement(args, experiment: str):
    """(world size, hosts, ranks per host) from --world-size, --hosts and --ranks-per-host."""
    if args.hosts is None and args.ranks_per_host is None:
        return args.world_size, None, None
    if args.link is None:
        raise SystemExit(f"python -m benchmarks {experiment}: --hosts and --ranks-per-host need --link")
    per_host = args.ranks_per_host or 1
    count = args.hosts or args.world_size // per_host
    if count < 1 or per_host < 1 or (args.hosts is None and args.world_size % per_host):
        raise SystemExit(f"python -m benchmarks {experiment}: cannot place --world-size {args.world_size} as "
                         f"--hosts {args.hosts} x --ranks-per-host {args.ranks_per_host}")
    return count * per_host, count, per_host


def _options(args, experiment: str, part_of_all: bool = False) -> BenchOptions:
    from benchmarks.experiments import EXPERIMENTS

    # Run lengths: given on the command line, else --quick's, else the experiment's own defaults.
    lengths = quick_lengths() if args.quick else dict(getattr(EXPERIMENTS[experiment], "RUN_LENGTHS", {}))
    for name in ("warmup", "blocks", "block_iterations", "discard_per_block"):
        if getattr(args, name) is not None:
            lengths[name] = getattr(args, name)
    default_models = OWN_MODELS.get(experiment) or (["resnet50"] if experiment == "nosync" else list(MODELS))
    valid = OWN_MODELS.get(experiment) or MODELS
    models = args.models or list(default_models)
    if part_of_all:
        # `all --models ...` names models of some experiments: each of the
        # others runs its own defaults.
        models = [m for m in models if m in valid] or list(default_models)
    wrong = [m for m in models if m not in valid]
    if wrong:
        raise SystemExit(f"python -m benchmarks {experiment}: --models {' '.join(wrong)} is not one of its models")
    caps = args.bucket_cap_mb or ([0, 1, 5, 10, 25, 50, 100] if experiment == "bucket" else [None])
    soak = args.soak_iterations or (QUICK_SOAK_ITERATIONS if args.quick else BenchOptions.soak_iterations)
    if args.backend == "ddp_ext_mpi" and experiment not in BACKEND_EXPERIMENTS:
        raise SystemExit(f"python -m benchmarks {experiment}: --backend {args.backend} is for "
                         f"{' and '.join(BACKEND_EXPERIMENTS)} only")
    if args.link is not None and experiment not in LINK_EXPERIMENTS and not part_of_all:
        raise SystemExit(f"python -m benchmarks {experiment}: --link is for {' and '.join(LINK_EXPERIMENTS)} only")
    if args.configs and experiment not in LINK_EXPERIMENTS and not part_of_all:
        raise SystemExit(f"python -m benchmarks {experiment}: --configs is for {' and '.join(LINK_EXPERIMENTS)} only")
    if args.configs and (args.link is not None or args.hosts or args.ranks_per_host):
        raise SystemExit(f"python -m benchmarks {experiment}: --configs names each configuration's link and "
                         "placement: leave out --link, --hosts and --ranks-per-host")
    world_size, host_count, per_host = args.world_size, None, None
    if experiment in LINK_EXPERIMENTS:
        world_size, host_count, per_host = _placement(args, experiment)
    elif (args.hosts or args.ranks_per_host) and not part_of_all:
        raise SystemExit(f"python -m benchmarks {experiment}: --hosts and --ranks-per-host are for "
                         f"{' and '.join(LINK_EXPERIMENTS)} only")
    return BenchOptions(
        experiment=experiment, preset=args.preset, world_size=world_size, bucket_cap_mb=tuple(caps),
        models=tuple(models), out=args.out or BenchOptions.out, tag=args.tag, seed=args.seed, threads=args.threads,
        world_sizes=tuple(args.world_sizes), sync_every=tuple(args.sync_every), rr_groups=tuple(args.rr_groups),
        auto=args.auto and experiment == "bucket", hang_watch_cost=args.hang_watch_cost and experiment == "compare", round_robin=not args.no_round_robin, convergence_iterations=args.convergence_iterations,
        allreduce_elements=args.allreduce_elements, soak_iterations=soak, timeout_s=args.timeout, quick=args.quick,
        device=args.device, backend=args.backend or "",
        link_gbit=args.link if experiment in LINK_EXPERIMENTS else None, hosts=host_count, ranks_per_host=per_host,
        configs=args.configs if experiment in LINK_EXPERIMENTS else (), steps=args.steps, **lengths,
    )


def _device_problem(args) -> str:
    if args.device == "cpu" and args.backend != "nccl":
        return ""  # the default: nothing to check, CUDA left alone
    import torch

    available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    return device_problem(args.experiment, args.device, args.backend or "", available, args.world_size, gpus) or ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    problem = _device_problem(args)
    if problem:
        print(f"python -m benchmarks {args.experiment}: {problem}", file=sys.stderr)
        return 2
    missing = extra.missing()
    if missing:
        print(extra.missing_message(missing), file=sys.stderr)
        return 2
    if args.experiment == "report":
        from benchmarks import report

        report.write_document(args.out or report.RESULTS_DIR, report.TEXT_DIR, args.doc or report.DOC_PATH)
        return 0
    from benchmarks.runner import run_experiment

    names = list(NAMES) if args.experiment == "all" else [args.experiment]
    unavailable = []
    for name in names:
        # The command that reruns this one experiment alone.
        command = shlex.join(["python", "-m", "benchmarks", *(name if a == "all" else a for a in argv)])
        try:
            run_experiment(_options(args, name, part_of_all=args.experiment == "all"), command)
        except RoundRobinUnavailable as error:
            print(f"benchmarks {name}: {error}", file=sys.stderr)
            unavailable.append(name)
    if unavailable:
        print(f"benchmarks: not measured: {', '.join(unavailable)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
