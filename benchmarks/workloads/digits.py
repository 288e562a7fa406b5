"""scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), batched per rank.

The convergence experiment trains on real data, as the paper does with MNIST;
these images ship inside scikit-learn, so nothing is downloaded.
"""

from typing import Iterator, Optional, Tuple

import torch


def load_digits_tensors() -> Tuple[torch.Tensor, torch.Tensor]:
    """Images as (N, 1, 8, 8) float32 in [0, 1] and labels as (N,) int64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError("the convergence benchmark needs scikit-learn: pip install 'ddp_ext[bench]' "
                          "or pip install scikit-learn") from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.int64)


Data = Tuple[torch.Tensor, torch.Tensor]  # (images, labels)


def train_test_split(test_fraction: float, seed: int) -> Tuple[Data, Data]:
    """The digits split at random (the same split for the same seed) into
    training and test images; the test part holds `test_fraction` of them."""
    images, labels = load_digits_tensors()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    test = order[:int(len(images) * test_fraction)]
    train = order[len(test):]
    return (images[train], labels[train]), (images[test], labels[test])


def rank_batches(rank: int, world_size: int, batch_size: int, seed: int,
                 data: Optional[Data] = None) -> Iterator[Data]:
    """Endless (images, labels) batches of `batch_size` for one rank.

    Every epoch all ranks draw the same seeded permutation and rank r takes the
    r-th slice of each consecutive run of world_size * batch_size images, so
    ranks never see the same image in one iteration. An incomplete last run is
    dropped. `data` replaces the full set of digits (e.g. a training split).
    """
    images, labels = data if data is not None else load_digits_tensors()
    per_iteration = batch_size * world_size
    if per_iteration > len(images):
        raise ValueError(f"batch size {batch_size} x {world_size} ranks exceeds the {len(images)} digits images")
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images) - per_iteration + 1, per_iteration):
            chosen = order[start + rank * batch_size: start + (rank + 1) * batch_size]
            yield images[chosen], labels[chosen]
