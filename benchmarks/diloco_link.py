"""Some of the `diloco` experiment's variants on one link, summarised as
the experiment does (torch's DDP always runs: the others are read against
it). A shorter way to rerun the rows one change touches; the experiment
itself (`python -m benchmarks diloco`) runs every variant on both links.

    python -m benchmarks.diloco_link [--link-gbit 0.1] [--variants diloco_int8,streaming_int4]

Prints one JSON line per variant: the experiment's summary row. Needs root
(network namespaces) for a link; without, the loopback, no bytes counted.
"""

import argparse
import json

from benchmarks.experiments import diloco as experiment
from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness.progress import Progress
from benchmarks.workloads import diloco_variants as dv
from benchmarks.workloads import stdlib_text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--link-gbit", type=float, default=experiment.TIME_TARGET_LINK)
    parser.add_argument("--variants", default=f"{dv.DILOCO_INT8},{dv.STREAMING_INT8},{dv.DILOCO_INT4}")
    parser.add_argument("--steps", type=int, default=experiment.DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = [dv.TORCH] + [v for v in args.variants.split(",") if v != dv.TORCH]
    unknown = [v for v in variants if v not in dv.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(dv.VARIANTS)}")
    plan = experiment.Plan(dv.TrainSettings(), steps=args.steps, overrun=experiment.OVERRUN,
                           eval_every=experiment.EVAL_EVERY, seed=args.seed)
    corpus = stdlib_text.load(experiment.TRAIN_BYTES, experiment.HELD_OUT_BYTES)
    link = None if hosts.cannot_make_namespaces() else args.link_gbit
    records = experiment.run_link(plan, link, corpus, Progress("diloco_link", enabled=True), 7200.0,
                                  variants=tuple(variants))
    for row in experiment.summarize(link, records, plan, experiment.HOSTS * experiment.RANKS_PER_HOST):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
