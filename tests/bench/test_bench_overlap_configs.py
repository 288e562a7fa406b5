"""`python -m benchmarks overlap --configs ...` runs several configurations in one run.

A --quick run of the tiny model on the loopback and over 1 Gbit/s links at
2 hosts x 2 ranks writes one result whose rows hold both configurations
(over links only where network namespaces can be made; elsewhere that
configuration is skipped, with the reason in the notes); over the links, at
4 ranks, the bitwise check passes, the link's bound is the ring's bytes over
1 Gbit/s, and the notes say how the links were shaped. --configs is
parsed strictly: a wrong spelling or a repeat is an error that says so, and
a configuration that cannot run is skipped without a launch of ranks.
"""

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments import overlap  # noqa: E402
from benchmarks.harness import fake_hosts as hosts  # noqa: E402
from benchmarks.harness import link_configs  # noqa: E402
from benchmarks.harness.link_configs import LinkConfig  # noqa: E402
from benchmarks.harness.options import BenchOptions  # noqa: E402
from benchmarks.workloads import tiny_mlp  # noqa: E402
from tests.bench.test_bench_overlap import _check_rows, _overlap_options, _quick_overlap  # noqa: E402


def test_configs_run_side_by_side_in_one_result(tmp_path):
    done, result = _quick_overlap(tmp_path, "--configs", "loopback,1gbit:2x2", models=("tiny",))
    assert result["options"]["configs"] == ["loopback", "1gbit:2x2"]
    _check_rows({**result, "rows": [r for r in result["rows"] if r["link"] == "loopback"]}, ("tiny",),
                (1, 2, "loopback"))
    assert result["configs"]["loopback"]["models"]["tiny"]["bitwise_equal"]["equal"] is True
    reason = hosts.cannot_make_namespaces()
    linked = [r for r in result["rows"] if r["link"] == "1gbit"]
    if reason:
        assert not linked and result["configs"]["1gbit:2x2"] == {"skipped": reason}
        assert f"1gbit:2x2 not measured: {reason}" in result["notes"]
        return
    _check_rows({**result, "rows": linked}, ("tiny",), (2, 2, "1gbit"))
    shaped = result["configs"]["1gbit:2x2"]["models"]["tiny"]
    assert shaped["bitwise_equal"] == {"equal": True, "ranks": 4,
                                       "tensors_per_rank": len(list(tiny_mlp.build_mlp(0).parameters()))}
    assert linked[0]["link_ms"] == pytest.approx(1.5 * shaped["gradient_bytes"] * 8 / 1e9 * 1e3)
    assert any("shaped to 1 Gbit/s" in note and "2 hosts of 2 rank(s)" in note for note in result["notes"])
    assert "| tiny | 1x2 loopback | ddp_ext + overlap_optimizer |" in done.stdout
    assert "| tiny | 2x2 1gbit | ddp_ext + overlap_optimizer |" in done.stdout
    assert "Phases, configuration `1gbit:2x2`:" in done.stdout
    assert (tmp_path / "overlap.png").stat().st_size > 0


def test_configs_parse_and_name_themselves():
    assert [c.name for c in link_configs.parse("all")] == list(link_configs.ALL)
    assert link_configs.parse("loopback, 10Gbit:2x2,2.5gbit:3x1") == (
        LinkConfig(), LinkConfig(10.0, 2, 2), LinkConfig(2.5, 3, 1))
    assert link_configs.parse_one("2.5gbit:3x1").name == "2.5gbit:3x1"
    for wrong in ("loopbak", "1gbit", "1gbit:2", "1gbit:2x0", "1gbit:x2", "1gbit:2x1x1", "1gbit:2 x 1", "", "all,"):
        with pytest.raises(ValueError, match="is not loopback or <rate>gbit:<hosts>x<ranks per host>"):
            link_configs.parse(wrong)
    for wrong in ("fast:2x1", "1mbit:2x1", "0gbit:2x1"):
        with pytest.raises(ValueError, match="is not a rate such as 1gbit"):
            link_configs.parse(wrong)
    with pytest.raises(ValueError, match="given twice: 1gbit:2x1"):
        link_configs.parse("1gbit:2x1,loopback,1Gbit:2x1")


def test_configs_on_the_command_line(capsys):
    assert _overlap_options("--configs", "all").configs == link_configs.ALL
    assert _overlap_options().configs == ()
    with pytest.raises(SystemExit):
        _overlap_options("--configs", "1gbit:two")
    assert "configuration '1gbit:two' is not loopback or" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="leave out --link"):
        _overlap_options("--configs", "loopback", "--link", "1gbit")


def test_a_config_sets_the_options_of_its_run():
    options = BenchOptions(experiment="overlap", world_size=3, configs=("loopback", "1gbit:2x2"))
    alone = LinkConfig(1.0, 2, 2).options(options)
    assert (alone.configs, alone.link_gbit, alone.hosts, alone.ranks_per_host, alone.world_size) == ((), 1.0, 2, 2, 4)
    loopback = LinkConfig().options(alone)
    assert (loopback.link_gbit, loopback.hosts, loopback.ranks_per_host, loopback.world_size) == (None, None, None, 4)


def test_a_config_that_cannot_run_is_skipped_with_its_reason(monkeypatch):
    launched = []

    def run_one(options, progress):
        launched.append(options.link_gbit)
        return {"rows": [{"ranks": options.world_size}], "models": {}, "notes": ["general"]}

    monkeypatch.setattr(overlap, "run_one", run_one)
    monkeypatch.setattr(overlap, "targets", lambda rows: [])
    monkeypatch.setattr(hosts, "cannot_make_namespaces", lambda: "needs root")

    class Quiet:
        def say(self, text):
            pass

    result = overlap.run(BenchOptions(experiment="overlap", configs=("loopback", "10gbit:2x2")), Quiet())
    assert launched == [None]
    assert result["configs"] == {"loopback": {"hosts": 1, "ranks_per_host": 2, "models": {}},
                                 "10gbit:2x2": {"skipped": "needs root"}}
    assert result["notes"] == ["general", "10gbit:2x2 not measured: needs root"]
    assert "Configuration `10gbit:2x2`: skipped (needs root)" in overlap._phase_tables(result)
