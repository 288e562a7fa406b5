"""The benchmarks moved out of the installed package: they run from a checkout
of the repository, `python -m benchmarks <experiment>` at its root (see
docs/BENCHMARKS.md). `python -m ddp_ext.bench` only says so."""

import shlex
import sys

MOVED = ("ddp_ext.bench has moved: the benchmarks now run from a checkout of the ddp_ext repository, at its root:\n\n"
         "    python -m benchmarks {args}\n\n"
         "(see docs/BENCHMARKS.md there)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(MOVED.format(args=shlex.join(argv) or "<experiment> [options]"), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
