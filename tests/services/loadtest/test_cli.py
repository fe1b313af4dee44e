"""The command line: arguments to a benchmark spec, and bad input reported before any load."""

from __future__ import annotations

import math

import pytest
from baton.services.cli import build_parser
from baton.services.cli import main as baton_main
from baton.services.loadtest.cli import build_spec


def parse(*argv):
    return build_parser().parse_args(["bench", "run", *argv])


def test_defaults():
    spec = build_spec(parse())
    assert (spec.backend, spec.address, spec.application) == ("grpc", "127.0.0.1:9000", "baton")
    assert spec.bounds.num_requests == 100 and spec.bounds.duration_s is None
    assert [(load.rate, load.max_concurrency) for load in spec.loads] == [(math.inf, None)]
    assert (spec.slo.ttft_s, spec.slo.tpot_s, spec.slo.e2e_s) == (1.0, 0.1, None)
    assert spec.sampling.ignore_eos and spec.sampling.temperature == 0.0
    assert spec.workload.describe()["classes"][0]["prompt_len"] == "128"
    assert build_spec(parse("--backend", "openai")).address == "http://127.0.0.1:8000"


def test_sweeps_and_bounds():
    spec = build_spec(parse("--rate", "1,2.5,4", "--burstiness", "0.5", "--max-concurrency", "8", "--duration", "30"))
    assert [(x.rate, x.burstiness, x.max_concurrency) for x in spec.loads] == [
        (1.0, 0.5, 8),
        (2.5, 0.5, 8),
        (4.0, 0.5, 8),
    ]
    assert spec.bounds.num_requests is None and spec.bounds.duration_s == 30
    spec = build_spec(parse("--concurrency", "1,4", "--num-requests", "10"))
    assert [(x.rate, x.max_concurrency) for x in spec.loads] == [(math.inf, 1), (math.inf, 4)]


def test_workloads_from_arguments(tmp_path):
    spec = build_spec(parse("--class", "long,1,uniform:900:1100,16", "--class", "short,3,64,normal:64:8"))
    assert [c["name"] for c in spec.workload.describe()["classes"]] == ["long", "short"]
    spec = build_spec(parse("--workload", "shared-prefix", "--num-groups", "3", "--popularity", "zipf:1.1"))
    assert spec.workload.describe() == {
        "name": "shared-prefix",
        "num_groups": 3,
        "prefix_len": "256",
        "suffix_len": "32",
        "output_len": "32",
        "popularity": "zipf:1.1",
    }
    spec = build_spec(parse("--workload", "multi-turn", "--turns", "4", "--think-time-ms", "250"))
    assert spec.workload.num_turns == 4 and spec.workload.think_time_s == 0.25
    data = tmp_path / "d.json"
    data.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]')
    spec = build_spec(parse("--workload", "sharegpt", "--dataset", str(data), "--output-len", "12"))
    assert spec.workload.output_len == 12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "sharegpt"], "needs --dataset"),
        (["--workload", "sharegpt", "--dataset", "/nonexistent.json"], "cannot read the dataset"),
        (["--rate", "2", "--concurrency", "4"], "not both"),
        (["--rate", "fast"], "comma-separated list"),
        (["--rate", "0"], "rate must be > 0"),
        (["--input-len", "uniform:9:1"], "length"),
        (["--popularity", "zipf:x", "--workload", "shared-prefix"], "popularity"),
        (["--num-requests", "0"], "request count"),
        (["--duration", "-1"], "duration"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    # the address is unreachable: these must fail on the input, before any connection
    assert baton_main(["bench", "run", "--address", "127.0.0.1:1", "--connect-timeout", "0.2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton bench: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_malformed_dataset_is_reported_before_the_server_is_tried(tmp_path, capsys):
    bad = tmp_path / "sharegpt.json"
    bad.write_text('[{"conversations": "oops"}]')
    assert (
        baton_main(["bench", "run", "--workload", "sharegpt", "--dataset", str(bad), "--address", "127.0.0.1:1"]) == 2
    )
    assert 'entry 0 has no "conversations" list' in capsys.readouterr().err


def test_unreachable_server(capsys):
    assert (
        baton_main(["bench", "run", "--address", "127.0.0.1:1", "--connect-timeout", "0.3", "--out", "/nonexistent"])
        == 2
    )
    assert "cannot reach the Baton gRPC server at 127.0.0.1:1" in capsys.readouterr().err


def test_unknown_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--backend", "nope")
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_compare_needs_two_files(tmp_path, capsys):
    assert baton_main(["bench", "compare", str(tmp_path / "one.json")]) == 2
    assert "two or more result files" in capsys.readouterr().err
