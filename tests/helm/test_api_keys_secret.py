"""API keys from a Secret: every Ray pod gets them as the variables config.server.auth names,
the API-key entry required and the admin entry optional; without a Secret, no variable."""

from __future__ import annotations

from testlib.helm_chart import HelmChart, head_group, ray_container, values_file, worker_groups

SECRET = {"apiKeys": {"existingSecret": "baton-api-keys"}}


def key_env(objects) -> dict[str, list]:
    """Per Ray pod kind, its environment entries that come from the API-key Secret."""
    groups = {"head": head_group(objects), **worker_groups(objects)}
    return {
        name: [
            entry
            for entry in ray_container(group).get("env", [])
            if entry.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "baton-api-keys"
        ]
        for name, group in groups.items()
    }


def test_every_ray_pod_reads_the_keys_from_the_secret(chart: HelmChart):
    per_pod = key_env(chart.render([values_file("minimal")], SECRET))
    assert set(per_pod) == {"head", "prefill", "decode"}
    for entries in per_pod.values():
        assert sorted(entries, key=lambda e: e["name"]) == [
            {
                "name": "BATON_ADMIN_API_KEYS",
                "valueFrom": {"secretKeyRef": {"name": "baton-api-keys", "key": "admin-api-keys", "optional": True}},
            },
            {"name": "BATON_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "baton-api-keys", "key": "api-keys"}}},
        ]


def test_the_variables_follow_the_config_and_the_admin_entry_may_be_left_out(chart: HelmChart):
    values = {
        "config": {"server": {"auth": {"api_keys_env": "MY_KEYS", "protect_health": True}}},
        "apiKeys": {"existingSecret": "baton-api-keys", "key": "keys", "adminKey": ""},
    }
    for entries in key_env(chart.render([values_file("minimal")], values)).values():
        assert entries == [
            {"name": "MY_KEYS", "valueFrom": {"secretKeyRef": {"name": "baton-api-keys", "key": "keys"}}}
        ]


def test_without_a_secret_no_pod_gets_a_key_variable(rendered):
    objects = rendered("minimal")
    assert all(entries == [] for entries in key_env(objects).values())
    for group in (head_group(objects), *worker_groups(objects).values()):
        assert not any("API_KEYS" in entry["name"] for entry in ray_container(group).get("env", []))


def test_helm_refuses_an_empty_api_key_entry(chart: HelmChart):
    error = chart.template_error([values_file("minimal")], {"apiKeys": {"existingSecret": "s", "key": ""}})
    assert "at '/apiKeys/key'" in error, error
