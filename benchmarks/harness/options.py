"""Everything one benchmark run is told, as a picklable record passed to every rank."""

import dataclasses
from typing import Optional, Tuple

# bucket_cap_mb 0 in the paper means "every gradient is allreduced on its own".
# ddp_ext rejects caps <= 0, so 0 is measured as a cap of one byte, which gives
# every parameter a bucket of its own in both ddp_ext and torch's DDP.
ONE_PARAMETER_PER_BUCKET_MB = 1 / 2**20


def effective_bucket_cap_mb(cap: Optional[float]) -> Optional[float]:
    """The cap handed to the DDP constructors: None keeps each library's default."""
    if cap is None:
        return None
    return ONE_PARAMETER_PER_BUCKET_MB if cap == 0 else cap


@dataclasses.dataclass
class BenchOptions:
    experiment: str
    preset: str = "small"  # workload sizes, see workloads.presets.SIZES
    world_size: int = 2  # ranks (processes) per run
    bucket_cap_mb: Tuple[Optional[float], ...] = (None,)  # None: each DDP's own default
    models: Tuple[str, ...] = ("resnet50", "bert")
    out: str = "bench_out"  # directory for <experiment>.json, .png and .samples.json.gz
    tag: str = ""  # appended to the output file names: <experiment>-<tag>.json
    seed: int = 0  # model initialisation and synthetic inputs
    threads: int = 1  # torch intra-op threads per rank (torch.set_num_threads)
    warmup: int = 3  # unmeasured iterations per variant before the first block
    blocks: int = 10  # measured blocks per variant, variants alternating block by block
    block_iterations: int = 5  # measured iterations per block
    discard_per_block: int = 1  # unmeasured iterations at the start of each block (the switch)
    auto: bool = False  # bucket: also measure bucket_cap_mb="auto" beside ddp_ext's fixed caps
    hang_watch_cost: bool = False  # compare: also measure ddp_ext with hang attribution off
    world_sizes: Tuple[int, ...] = (1, 2, 3, 4)  # scale
    sync_every: Tuple[int, ...] = (1, 2, 4, 8)  # nosync
    rr_groups: Tuple[int, ...] = (1, 3, 5)  # roundrobin and allreduce
    round_robin: bool = True  # allreduce: also measure round-robin groups
    convergence_iterations: int = 0  # nosync convergence; 0: the preset's default
    allreduce_elements: int = 0  # allreduce total float32 values; 0: the preset's default
    soak_iterations: int = 2000  # faults: iterations of the memory soak
    timeout_s: float = 3600.0  # per launch of ranks
    quick: bool = False  # tiny run lengths, to check that everything works
    device: str = "cpu"  # "cpu", or "cuda" (compare only): models and batches on cuda:(rank % GPUs)
    # Process-group backend of the ranks: "" is gloo on the CPU and nccl with
    # --device cuda; ddp_ext_mpi starts the ranks with mpirun.
    backend: str = ""
    # overlap: each rank a host of its own (fake_hosts), links shaped to this rate; None: the loopback.
    link_gbit: Optional[float] = None
    # overlap with a link: hosts, and ranks on each (sharing its loopback); None: one rank per host.
    hosts: Optional[int] = None
    ranks_per_host: Optional[int] = None
    # overlap: the configurations to run in turn, as harness/link_configs.py spells them; (): the one above.
    configs: Tuple[str, ...] = ()
    # diloco: steps of torch's DDP (the others run more, see experiments/diloco.py); 0: the experiment's default.
    steps: int = 0

    def process_group_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")

    @property
    def output_name(self) -> str:
        return f"{self.experiment}-{self.tag}" if self.tag else self.experiment

    def single_bucket_cap(self) -> Optional[float]:
        if len(self.bucket_cap_mb) != 1:
            raise ValueError(f"{self.experiment} takes one --bucket-cap-mb value, got {list(self.bucket_cap_mb)}")
        return self.bucket_cap_mb[0]

    def run_lengths(self) -> dict:
        return {k: getattr(self, k) for k in ("warmup", "blocks", "block_iterations", "discard_per_block")}


# Experiments that run on CUDA with --device cuda.
CUDA_EXPERIMENTS = ("compare",)


def device_problem(experiment: str, device: str, backend: str, cuda_available: bool, world_size: int = 1,
                   gpus: int = 0) -> Optional[str]:
    """Why `--device device --backend backend` cannot run `experiment` on
    `world_size` ranks with `gpus` GPUs, or None."""
    if device == "cpu":
        return f"--backend {backend} needs --device cuda" if backend == "nccl" else None
    if experiment not in CUDA_EXPERIMENTS:
        return f"--device {device} is supported by {', '.join(CUDA_EXPERIMENTS)} only, not {experiment}"
    if not cuda_available:
        return "--device cuda: no CUDA device (torch.cuda.is_available() is False)"
    if backend in ("", "nccl") and world_size > gpus:
        return (f"NCCL needs a GPU per rank: --world-size {world_size} with {gpus} GPU(s); "
                "use --backend gloo to share GPUs between ranks")
    return None


def quick_lengths() -> dict:
    """Run lengths for --quick: enough to exercise every code path, not to measure."""
    return {"warmup": 1, "blocks": 2, "block_iterations": 2, "discard_per_block": 0}
