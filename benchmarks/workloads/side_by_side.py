"""Rank bodies that measure variants of one training step side by side, per
model (Note [Interleaved measurement]): compare, scale and breakdown use them."""

import torch

from benchmarks.harness.interleave import run_interleaved
from benchmarks.harness.options import effective_bucket_cap_mb
from benchmarks.workloads.presets import Workload, input_seed
from benchmarks.workloads.replicas import KINDS, OURS_NO_HANG_WATCH, make_replica
from benchmarks.workloads.training_step import TrainingStep


def measure_models(rank, job, build_variants):
    """Per model, the training steps `build_variants(workload, batch, seed, cap)`
    returns, measured interleaved on this rank; shared by the experiments that
    compare variants of one training step."""
    options, progress = job
    progress = progress.for_rank(rank)
    cap = effective_bucket_cap_mb(options.single_bucket_cap())
    device = rank_device(options.device, rank)
    measured = {}
    for model in options.models:
        workload = Workload(model, options.preset)
        batch = tuple(t.to(device) for t in workload.batch(input_seed(options.seed, rank)))
        variants = build_variants(workload, batch, options.seed, cap)
        measured[model] = run_interleaved(variants, **options.run_lengths(), progress=progress, label=model)
    return measured


def rank_device(device: str, rank: int) -> torch.device:
    """Where this rank's replicas and batches live: the CPU, or
    cuda:(rank % GPUs), made current."""
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _kinds(workload, batch, seed, cap):
    device = batch[0].device
    return {kind: TrainingStep(make_replica(kind, workload, seed, cap, device=device), batch) for kind in KINDS}


def measure_kinds(rank, world_size, job):
    """Rank body: ours, torch and local interleaved, per model (compare and scale)."""
    return measure_models(rank, job, _kinds)


def _kinds_and_no_hang_watch(workload, batch, seed, cap):
    variants = _kinds(workload, batch, seed, cap)
    device = batch[0].device
    variants[OURS_NO_HANG_WATCH] = TrainingStep(
        make_replica(OURS_NO_HANG_WATCH, workload, seed, cap, device=device), batch
    )
    return variants


def measure_kinds_and_no_hang_watch(rank, world_size, job):
    """Rank body of compare --hang-watch-cost: also ddp_ext with hang attribution off."""
    return measure_models(rank, job, _kinds_and_no_hang_watch)
