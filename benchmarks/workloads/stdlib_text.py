"""Text every machine with Python has: the standard library's own source,
as bytes (a vocabulary of 256), for the `diloco` experiment's character
model.

Files are the .py files under os.path.dirname(os.__file__), site-packages
and dist-packages left out (they differ between machines), read in sorted
order of their relative paths. Every HELD_OUT_EVERY-th file is held out for
evaluation; the others are training text, read until `max_bytes`. The
digest names the text, so runs on different Python versions can be told
apart.
"""

import dataclasses
import hashlib
import os
from typing import List

import torch

STDLIB = os.path.dirname(os.__file__)
SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")
HELD_OUT_EVERY = 20


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor  # uint8, the training text
    held_out: torch.Tensor  # uint8, text of other files
    files: int  # files read
    digest: str  # sha256 of the training then the held-out text, first 12 hex digits

    def describe(self) -> dict:
        return {"train_bytes": self.train.numel(), "held_out_bytes": self.held_out.numel(), "files": self.files,
                "digest": self.digest}


def source_files(root: str = STDLIB) -> List[str]:
    """The .py files under `root`, as paths relative to it, sorted."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        found += [os.path.relpath(os.path.join(directory, n), root) for n in names if n.endswith(".py")]
    return sorted(found)


def load(max_bytes: int, held_out_bytes: int, root: str = STDLIB) -> Corpus:
    """At most `max_bytes` of training text and `held_out_bytes` of held-out text."""
    train, held_out, files = bytearray(), bytearray(), 0
    for i, path in enumerate(source_files(root)):
        target, limit = (held_out, held_out_bytes) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else (train, max_bytes)
        if len(target) >= limit:
            if len(train) >= max_bytes and len(held_out) >= held_out_bytes:
                break
            continue
        with open(os.path.join(root, path), "rb") as f:
            target += f.read()[:limit - len(target)]
        files += 1
    digest = hashlib.sha256(bytes(train) + bytes(held_out)).hexdigest()[:12]
    return Corpus(_as_tensor(train), _as_tensor(held_out), files, digest)


def _as_tensor(text: bytearray) -> torch.Tensor:
    return torch.frombuffer(text, dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)


def random_batch(text: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """(inputs, next characters), each `batch` x `context` int64, from random places in `text`."""
    starts = torch.randint(0, text.numel() - context - 1, (batch,), generator=generator)
    return _windows(text, starts, context)


def even_batch(text: torch.Tensor, batch: int, context: int):
    """Like random_batch, from `batch` places spread evenly over `text`: a fixed evaluation set."""
    starts = torch.linspace(0, text.numel() - context - 2, batch).long()
    return _windows(text, starts, context)


def _windows(text: torch.Tensor, starts: torch.Tensor, context: int):
    index = starts[:, None] + torch.arange(context + 1)[None, :]
    windows = text[index].long()
    return windows[:, :-1], windows[:, 1:]


def tokens_seen(steps: int, ranks: int, batch: int, context: int) -> int:
    """Characters predicted by all ranks together after `steps` steps."""
    return steps * ranks * batch * context
