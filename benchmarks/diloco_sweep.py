"""A sweep of DiLoCo's settings for the `diloco` experiment's quality at
equal tokens: torch's DDP once, then DiLoCo with each (H, outer lr,
outer momentum, bits; fragments, delay and mix for streaming), every run the experiment's workload on the loopback
(the link changes time, not loss), as many steps as torch's DDP. Prints
one line per setting: its held-out loss at the last step, over torch's.

    python -m benchmarks.diloco_sweep [--steps 500] [--configs 50:0.7:0.5:32,...]

A setting is H:outer_lr:outer_momentum:bits, or H:outer_lr:outer_momentum:bits:F:tau:mix
for streaming DiLoCo (bits 32, 8 or 4).
"""

import argparse
import dataclasses
import json
import time

from benchmarks.experiments import diloco as experiment
from benchmarks.harness.progress import Progress
from benchmarks.workloads import diloco_variants as dv
from benchmarks.workloads import stdlib_text

DEFAULT_CONFIGS = "50:0.7:0.5:32,50:1.0:0.0:32,25:0.7:0.5:32,25:1.0:0.0:32,10:0.7:0.5:32,10:1.0:0.0:32"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=experiment.DEFAULT_STEPS)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="H:outer_lr:outer_momentum:bits[:F:tau:mix], comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="skip torch's DDP (give --torch-loss)")
    parser.add_argument("--torch-loss", type=float, default=None)
    args = parser.parse_args(argv)
    corpus = stdlib_text.load(experiment.TRAIN_BYTES, experiment.HELD_OUT_BYTES)
    progress = Progress("diloco_sweep", enabled=False)
    base = experiment.Plan(dv.TrainSettings(), steps=args.steps, overrun=1.0, eval_every=args.steps, seed=args.seed)
    torch_loss = args.torch_loss
    if not args.no_torch:
        record = experiment.run_link(base, None, corpus, progress, 7200.0, variants=(dv.TORCH,))[dv.TORCH]
        torch_loss = experiment.loss_at(record, args.steps)
        print(json.dumps({"variant": "torch", "loss": torch_loss, "wall_s": record["wall_s"]}), flush=True)
    for config in args.configs.split(","):
        sync_every, outer_lr, momentum, bits, *streaming = config.split(":")
        settings = dataclasses.replace(base.settings, sync_every=int(sync_every), outer_lr=float(outer_lr),
                                       outer_momentum=float(momentum))
        variant = {"32": dv.DILOCO, "8": dv.DILOCO_INT8, "4": dv.DILOCO_INT4}[bits]
        if streaming:  # fragments, delay, mix: streaming DiLoCo, in 32, 8 or 4 bits
            fragments, delay, mix = streaming
            settings = dataclasses.replace(settings, fragments=int(fragments), delay=int(delay), mix=float(mix))
            variant = {"32": dv.STREAMING, "8": dv.STREAMING_INT8, "4": dv.STREAMING_INT4}[bits]
        plan = dataclasses.replace(base, settings=settings)
        started = time.perf_counter()
        record = experiment.run_link(plan, None, corpus, progress, 7200.0, variants=(variant,))[variant]
        loss = experiment.loss_at(record, args.steps)
        print(json.dumps({"config": config, "loss": loss, "over_torch": loss / torch_loss if torch_loss else None,
                          "wall_s": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main()
