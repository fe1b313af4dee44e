"""The `baton` command line without a server: `serve`'s flags and `--set` overrides (validated by
the config model, an unknown key named), how clients find the server (flag, BATON_ADDRESS,
config, defaults), `baton status`'s reading of Ray's metrics, and `baton serve` refusing a
bad key in one line before it starts anything."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml
from baton.services.cli import build_parser, find_server, serve_overrides
from baton.services.client import read_metrics
from baton.services.config import config_override, config_overrides, load_config

MODEL = {"engine": {"model": {"model": "/models/m"}}}


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("server.http_port=8001", {"server": {"http_port": 8001}}),
        ("server.http_host=0.0.0.0", {"server": {"http_host": "0.0.0.0"}}),
        ("engine.cache.enable_prefix_caching=false", {"engine": {"cache": {"enable_prefix_caching": False}}}),
        ("server.request_timeout_s=null", {"server": {"request_timeout_s": None}}),
        ("router.redis.url=redis://r:6379", {"router": {"redis": {"url": "redis://r:6379"}}}),
        (
            "colocated.engine_overrides.scheduler.max_num_seqs=8",
            {"colocated": {"engine_overrides": {"scheduler": {"max_num_seqs": 8}}}},
        ),
        ("engine.model.served_model_name=a=b", {"engine": {"model": {"served_model_name": "a=b"}}}),
    ],
)
def test_a_set_assignment_is_a_nested_override_with_a_yaml_value(assignment, expected):
    assert config_override(assignment) == expected


def test_set_assignments_merge_and_the_config_model_takes_them():
    overrides = config_overrides(["server.http_port=8001", "server.grpc_port=9001", "server.http_port=8002"])
    assert overrides == {"server": {"http_port": 8002, "grpc_port": 9001}}
    config = load_config(None, {**MODEL, **overrides, **config_override("router.placement=round_robin")})
    assert (config.server.http_port, config.server.grpc_port, config.router.placement) == (8002, 9001, "round_robin")


@pytest.mark.parametrize(
    ("assignment", "named"),
    [
        ("server.htp_port=1", "unknown config key 'server.htp_port': server has no 'htp_port'"),
        ("colocated.replicas=2", "unknown config key 'colocated.replicas'"),
        ("serverr.http_port=1", "the config has no 'serverr'"),
        ("server.http_port.low=1", "server.http_port is a value, not a section"),
        ("server.http_port", "expected section.key=value"),
    ],
)
def test_an_unknown_key_fails_naming_it(assignment, named):
    with pytest.raises(ValueError, match=named):
        config_override(assignment)


def test_a_bad_value_fails_validation_naming_the_key():
    with pytest.raises(ValueError, match=r"server\.http_port\n.*valid integer"):
        load_config(None, {**MODEL, **config_override("server.http_port=eighty")})
    with pytest.raises(ValueError, match=r"router\.placement"):
        load_config(None, {**MODEL, **config_override("router.placement=nearest")})


def test_serve_flags_become_server_overrides_and_win_over_set():
    args = serve_args("--set", "server.http_port=1", "--set", "colocated.num_replicas=2", "--http-port", "8001")
    args.grpc_port, args.metrics_port, args.host = 9001, 0, "0.0.0.0"
    assert serve_overrides(args) == {
        "server": {"http_port": 8001, "grpc_port": 9001, "metrics_port": 0, "http_host": "0.0.0.0"},
        "colocated": {"num_replicas": 2},
    }
    assert serve_overrides(serve_args()) == {}


def test_serve_help_groups_the_flags():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = {group.title: {a.dest for a in group._group_actions} for group in serve._action_groups}
    assert groups["config"] == {"config", "model", "set"}
    assert groups["network (flags win over the config and --set)"] == {"host", "http_port", "grpc_port", "metrics_port"}
    assert groups["running"] == {"grace_period", "log_level"}
    assert "SECTION.KEY=VALUE" in serve.format_help()


def test_clients_find_the_server_by_flag_then_env_then_config_then_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_ADDRESS", raising=False)
    monkeypatch.delenv("BATON_CONFIG", raising=False)
    default = find_server(None, None)
    assert (default.grpc, default.http, default.metrics) == (
        "127.0.0.1:9000",
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8080/metrics",
    )
    assert default.application == "baton"

    config = tmp_path / "baton.yaml"
    server = {"http_host": "0.0.0.0", "http_port": 18000, "grpc_port": 19000, "metrics_port": 18080}
    config.write_text(yaml.safe_dump({"name": "mine", "server": server}))
    found = find_server(None, str(config))
    assert (found.grpc, found.http, found.metrics, found.application) == (
        "127.0.0.1:19000",  # a wildcard listen address is dialled on loopback
        "http://127.0.0.1:18000",
        "http://127.0.0.1:18080/metrics",
        "mine",
    )
    monkeypatch.setenv("BATON_CONFIG", str(config))
    assert find_server(None, None).grpc == "127.0.0.1:19000"
    monkeypatch.setenv("BATON_ADDRESS", "10.0.0.5:9100")
    found = find_server(None, None)
    assert (found.grpc, found.metrics) == ("10.0.0.5:9100", "http://10.0.0.5:18080/metrics")
    assert find_server("host:1", None, "other").grpc == "host:1"
    assert find_server("host:1", None, "other").application == "other"


def test_client_commands_take_address_and_config():
    parser = build_parser()
    for argv in (["generate", "hi"], ["status"], ["bench", "run"]):
        args = parser.parse_args([*argv, "--address", "h:1", "--config", "c.yaml"])
        assert (args.address, args.config) == ("h:1", "c.yaml")


# Two workers and two deployments as Ray 2.60 exports them (labels trimmed to those read),
# plus a replica of another application, which is not counted.
METRICS = """\
# TYPE ray_serve_deployment_replica_healthy gauge
ray_serve_deployment_replica_healthy{application="baton",deployment="gateway",replica="a"} 1.0
ray_serve_deployment_replica_healthy{application="baton",deployment="prefill",replica="b"} 1.0
ray_serve_deployment_replica_healthy{application="baton",deployment="prefill",replica="c"} 0.0
ray_serve_deployment_replica_healthy{application="other",deployment="prefill",replica="d"} 1.0
# TYPE ray_serve_autoscaling_target_replicas gauge
ray_serve_autoscaling_target_replicas{application="baton",deployment="prefill"} 2.0
# TYPE ray_baton_kv_cache_usage_ratio gauge
ray_baton_kv_cache_usage_ratio{WorkerId="7c2987d8ba1d",role="prefill"} 0.25
ray_baton_kv_cache_usage_ratio{WorkerId="17e5339afb92",role="decode"} 0.5
# TYPE ray_baton_num_free_kv_blocks gauge
ray_baton_num_free_kv_blocks{WorkerId="7c2987d8ba1d",role="prefill"} 768.0
# TYPE ray_baton_num_requests_running gauge
ray_baton_num_requests_running{WorkerId="17e5339afb92",role="decode"} 3.0
# TYPE ray_baton_router_decisions_total counter
ray_baton_router_decisions_total{WorkerId="x",reason="prefix",role="prefill"} 4.0
ray_baton_router_decisions_total{WorkerId="x",reason="load",role="prefill"} 1.0
"""


def test_status_reads_replicas_kv_usage_and_router_decisions_from_rays_metrics():
    metrics = read_metrics(METRICS, "baton")
    assert {name: (r.healthy, r.total, r.target) for name, r in metrics.replicas.items()} == {
        "gateway": (1, 1, None),
        "prefill": (1, 2, 2),
    }
    assert [(w.role, w.worker_id, w.kv_usage, w.free_blocks, w.running) for w in metrics.workers] == [
        ("decode", "17e5339a", 0.5, 0, 3),
        ("prefill", "7c2987d8", 0.25, 768, 0),
    ]
    assert metrics.num_router_decisions == 5


def test_baton_serve_refuses_an_unknown_key_in_one_line_before_starting_anything():
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "serve", "--set", "server.htp_port=8001"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "baton serve: error: unknown config key 'server.htp_port': server has no 'htp_port' "
        "(it has http_host, http_port, grpc_host, grpc_port, metrics_port, request_timeout_s, direct_ingress, auth, limits, tls)"
    ]
    assert time.monotonic() - started < 30


def test_baton_serve_refuses_an_unreadable_api_key_file_in_one_line_before_starting_anything(tmp_path):
    missing = tmp_path / "api-keys"
    done = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "serve", "--model", str(tmp_path), "--set"]
        + [f"server.auth.api_keys_file={missing}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"baton serve: error: cannot read the API key file {missing}: No such file or directory"
    ]
