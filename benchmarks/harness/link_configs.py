"""The configurations `overlap --configs` runs in turn, one launch of ranks each.

A configuration is `loopback` (every rank on this machine's loopback, at
--world-size ranks) or `<rate>gbit:<H>x<R>`: H hosts, each a network
namespace whose link sends at the rate (harness/fake_hosts.py), with R
ranks on each. `all` stands for ALL.
"""

import dataclasses
from typing import Optional, Tuple

from benchmarks.harness import fake_hosts as hosts
from benchmarks.harness.options import BenchOptions

LOOPBACK = "loopback"
ALL = (LOOPBACK, "1gbit:2x1", "1gbit:2x2", "10gbit:2x1", "10gbit:2x2")
SPELLING = "loopback or <rate>gbit:<hosts>x<ranks per host>, e.g. 1gbit:2x2"


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    link_gbit: Optional[float] = None  # None: the loopback
    hosts: Optional[int] = None
    ranks_per_host: Optional[int] = None

    @property
    def name(self) -> str:
        """The configuration as --configs spells it."""
        if self.link_gbit is None:
            return LOOPBACK
        return f"{self.link_gbit:g}gbit:{self.hosts}x{self.ranks_per_host}"

    def options(self, options: BenchOptions) -> BenchOptions:
        """`options` for a run of this configuration alone."""
        if self.link_gbit is None:
            return dataclasses.replace(options, configs=(), link_gbit=None, hosts=None, ranks_per_host=None)
        return dataclasses.replace(options, configs=(), link_gbit=self.link_gbit, hosts=self.hosts,
                                   ranks_per_host=self.ranks_per_host,
                                   world_size=self.hosts * self.ranks_per_host)

    def cannot_run(self) -> Optional[str]:
        """Why this configuration cannot run on this machine, or None."""
        return None if self.link_gbit is None else hosts.cannot_make_namespaces()


def rate_gbit(text: str) -> float:
    """A link's rate: "1gbit", "10gbit", "2.5gbit" -> Gbit/s; ValueError otherwise."""
    try:
        rate = float(text.lower().removesuffix("gbit"))
    except ValueError:
        rate = 0.0
    if not text.lower().endswith("gbit") or rate <= 0:
        raise ValueError(f"{text!r} is not a rate such as 1gbit or 10gbit")
    return rate


def parse_one(text: str) -> LinkConfig:
    """One configuration from its spelling (see the module's docstring); ValueError if it is not one."""
    if text == LOOPBACK:
        return LinkConfig()
    rate, _, placement = text.partition(":")
    count, _, per_host = placement.partition("x")
    if not (count.isdigit() and per_host.isdigit() and int(count) >= 1 and int(per_host) >= 1):
        raise ValueError(f"configuration {text!r} is not {SPELLING}")
    return LinkConfig(rate_gbit(rate), int(count), int(per_host))


def parse(text: str) -> Tuple[LinkConfig, ...]:
    """A comma-separated list of configurations, or `all`; ValueError on a wrong spelling or a repeat."""
    configs = tuple(parse_one(part.strip()) for part in (",".join(ALL) if text == "all" else text).split(","))
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"configuration(s) given twice: {', '.join(repeated)}")
    return configs
