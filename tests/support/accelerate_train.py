"""Trains with HF Accelerate, once wrapping the model in ddp_ext's DDP and once
in torch's, for each case; launched by tests/frameworks/test_integration_accelerate.py as

    accelerate launch --multi_gpu --num_processes 2 tests/support/accelerate_train.py OUT_DIR

(with ``Accelerator(cpu=True)`` that is 2 CPU ranks over Gloo). Every rank
writes OUT_DIR/rank<r>.pt: case id -> (True, results) or (False, traceback).
"""

import contextlib
import os
import sys
import traceback
import warnings

import torch

STEPS = 4


def _accelerator(ext, **kwargs):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from ddp_ext.integrations.accelerate import Accelerator

    # Each case configures Accelerate anew; the process group stays.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return (Accelerator if ext else accelerate.Accelerator)(cpu=True, **kwargs)


def _setup(ext, **kwargs):
    from tests.support import frameworks

    acc = _accelerator(ext, **kwargs)
    net = frameworks.net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(frameworks.dataset(), batch_size=frameworks.BATCH)
    model, opt, loader = acc.prepare(net, opt, loader)
    return acc, net, model, opt, loader


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _steps(acc, model, opt, loader, accumulate=False):
    for i, batch in enumerate(loader):
        if i == STEPS * (2 if accumulate else 1):
            break
        # Inside accumulate(), the prepared optimizer steps only on synchronising batches.
        with acc.accumulate(model) if accumulate else contextlib.nullcontext():
            acc.backward(_loss(model, batch))
            opt.step()
            opt.zero_grad()


def _momentum(net, opt):
    return [opt.state[p]["momentum_buffer"].clone() for p in net.parameters()]


def _name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def case_prepare(ext, out_dir):
    """Plain steps, then unwrap_model, save_state and load_state."""
    from safetensors.torch import load_file

    from tests.support import frameworks

    acc, net, model, opt, loader = _setup(ext)
    _steps(acc, model, opt, loader)
    trained, momentum = frameworks.params(net), _momentum(net, opt)
    ckpt = os.path.join(out_dir, "ckpt_" + ("ext" if ext else "torch"))
    acc.save_state(ckpt)
    acc.wait_for_everyone()
    saved = load_file(os.path.join(ckpt, "model.safetensors"))
    # A fresh model and optimizer, loaded from the checkpoint.
    acc2, net2, model2, opt2, _ = _setup(ext)
    with torch.no_grad():
        for p in net2.parameters():
            p.zero_()
    acc2.load_state(ckpt)
    return {
        "params": trained,
        "wrapper": _name(type(model)),
        "unwrapped_is_net": acc.unwrap_model(model) is net,
        "saved": saved,
        "loaded": frameworks.params(net2),
        "momentum": momentum,
        "loaded_momentum": _momentum(net2, opt2),
    }


def case_accumulate(ext, out_dir):
    """accelerator.accumulate: every other backward under no_sync."""
    from tests.support import frameworks

    acc, net, model, opt, loader = _setup(ext, gradient_accumulation_steps=2)
    _steps(acc, model, opt, loader, accumulate=True)
    return {"params": frameworks.params(net)}


def case_trigger_sync(ext, out_dir):
    """Two forwards under no_sync; the second backward synchronises through
    trigger_sync_in_backward."""
    from tests.support import frameworks

    acc, net, model, opt, loader = _setup(ext)
    batches = iter(loader)
    for _ in range(STEPS):
        with acc.no_sync(model):
            loss_a = _loss(model, next(batches))
            loss_b = _loss(model, next(batches))
        acc.backward(loss_a)
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)
        opt.step()
        opt.zero_grad()
    return {"params": frameworks.params(net)}


def case_ddp_kwargs(ext, out_dir):
    """DistributedDataParallelKwargs' DDP arguments reach the wrapper."""
    from accelerate.utils import DistributedDataParallelKwargs

    from tests.support import frameworks

    handler = DistributedDataParallelKwargs(
        bucket_cap_mb=1, find_unused_parameters=True, check_reduction=True, gradient_as_bucket_view=True
    )
    acc, net, model, opt, loader = _setup(ext, kwargs_handlers=[handler])
    _steps(acc, model, opt, loader)
    chosen = {k: getattr(model, k) for k in ("bucket_bytes_cap", "find_unused_parameters", "gradient_as_bucket_view")}
    return {"params": frameworks.params(net), "chosen": chosen}


def case_comm_hook_fp16(ext, out_dir):
    """DistributedDataParallelKwargs(comm_hook=FP16): torch's fp16_compress_hook."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from tests.support import frameworks

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    acc, net, model, opt, loader = _setup(ext, kwargs_handlers=[handler])
    _steps(acc, model, opt, loader)
    return {"params": frameworks.params(net)}


def case_comm_hook_power_sgd(ext, out_dir):
    """comm_hook=POWER_SGD with comm_state_option: a PowerSGDState on the
    default group, compressing from the third step on, with error feedback."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from tests.support import frameworks

    handler = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType.POWER_SGD,
        comm_state_option=dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
    )
    acc, net, model, opt, loader = _setup(ext, kwargs_handlers=[handler])
    _steps(acc, model, opt, loader)
    return {"params": frameworks.params(net)}


CASES = {name[len("case_"):]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def main(out_dir):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for case_id, fn in CASES.items():
        try:
            results[case_id] = (True, {"ext": fn(True, out_dir), "torch": fn(False, out_dir)})
        except Exception:
            results[case_id] = (False, traceback.format_exc())
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
