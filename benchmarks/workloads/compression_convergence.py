"""The convergence half of `compression`: does a hook change what training reaches?

Every variant trains the same narrow ResNet-50 (as nosync's convergence run)
from the same seed on the same training digits in the same order, then rank 0
scores its replica on held-out test digits. Replicas agree after every
synchronised step, so rank 0's is the model.
"""

import torch
from torch.nn import functional as F

from benchmarks.workloads.compression_variants import ADAPTIVE_VARIANTS, HookSettings, decisions, wrap
from benchmarks.workloads.digits import rank_batches, train_test_split
from benchmarks.workloads.models import resnet50
from benchmarks.workloads.nosync_convergence import BASE_WIDTH

BATCH_SIZE = 32  # images per rank per iteration
LEARNING_RATE = 0.05
TEST_FRACTION = 0.2  # of the 1797 digits, held out
EPOCHS = 8
QUICK_ITERATIONS = 6


def iterations_per_epoch(world_size: int, train_images: int) -> int:
    return train_images // (BATCH_SIZE * world_size)


def train_and_test(rank: int, world_size: int, variant: str, preset: str, seed: int, hooks: HookSettings,
                   quick: bool) -> dict:
    """This rank's training losses; on rank 0 also the test loss and accuracy,
    and the adaptive hook's decisions."""
    train, (test_images, test_labels) = train_test_split(TEST_FRACTION, seed)
    per_epoch = iterations_per_epoch(world_size, len(train[0]))
    total = QUICK_ITERATIONS if quick else EPOCHS * per_epoch
    torch.manual_seed(seed)
    model = resnet50(base_width=BASE_WIDTH[preset], num_classes=10, in_channels=1, zero_init_residual=True)
    ddp, state = wrap(variant, model, hooks)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    batches = rank_batches(rank, world_size, BATCH_SIZE, seed, data=train)
    losses = []
    for _ in range(total):
        images, labels = next(batches)
        loss = F.cross_entropy(ddp(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    result = {"losses": losses, "iterations": total, "iterations_per_epoch": per_epoch}
    if variant in ADAPTIVE_VARIANTS:
        result["decisions"] = decisions(state)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            logits = model(test_images)
        result["test_loss"] = F.cross_entropy(logits, test_labels).item()
        result["test_accuracy"] = (logits.argmax(1) == test_labels).float().mean().item() * 100
        result["test_images"] = len(test_labels)
    return result
