"""API keys: read from the environment and from files, compared in constant time against every
key, callers known by a fingerprint, and no key ever in a message."""

from __future__ import annotations

import contextlib
import hmac

import pytest
from baton.services.gateway import api_keys as api_keys_module
from baton.services.gateway.api_keys import (
    ANONYMOUS,
    MALFORMED_HEADER,
    MISSING_KEY,
    WRONG_KEY,
    ApiKeys,
    AuthConfig,
    Caller,
)
from baton.services.serving_errors import UnauthenticatedError, status_of

KEY_A, KEY_B, ADMIN = "sk-alpha-0123456789abcdef", "sk-bravo-fedcba9876543210", "sk-admin-00112233445566"


@pytest.fixture
def keys() -> ApiKeys:
    return ApiKeys([KEY_A, KEY_B], [ADMIN])


def refusal(keys: ApiKeys, authorization: str | None) -> str:
    with pytest.raises(UnauthenticatedError) as info:
        keys.authenticate(authorization)
    return str(info.value)


def test_keys_come_from_the_environment_comma_separated():
    environ = {"BATON_API_KEYS": f" {KEY_A}, ,{KEY_B} ", "BATON_ADMIN_API_KEYS": ADMIN}
    keys = ApiKeys.from_config(AuthConfig(), environ)
    assert keys.authenticate(f"Bearer {KEY_A}") == keys.authenticate(f"Bearer {KEY_A}")
    assert not keys.authenticate(f"Bearer {KEY_B}").is_admin
    assert keys.authenticate(f"Bearer {ADMIN}").is_admin
    assert keys.describe() == (
        "API keys required: 2 API keys ($BATON_API_KEYS), 1 admin key ($BATON_ADMIN_API_KEYS); health checks open"
    )


def test_keys_come_from_files_one_a_line_with_the_environment_too(tmp_path):
    api_file, admin_file = tmp_path / "api-keys", tmp_path / "admin-keys"
    api_file.write_text(f"# rotated 2026-11\n{KEY_A}\n\n  {KEY_B}  \n")
    admin_file.write_text(f"{ADMIN}\n")
    config = AuthConfig(api_keys_file=str(api_file), admin_api_keys_file=str(admin_file), admin_api_keys_env=None)
    keys = ApiKeys.from_config(config, {"BATON_API_KEYS": "sk-from-env", "BATON_ADMIN_API_KEYS": "sk-not-read"})
    for key in (KEY_A, KEY_B, "sk-from-env"):
        assert not keys.authenticate(f"Bearer {key}").is_admin
    assert keys.authenticate(f"Bearer {ADMIN}").is_admin
    assert refusal(keys, "Bearer sk-not-read") == WRONG_KEY  # admin_api_keys_env: None
    assert refusal(keys, "Bearer # rotated 2026-11") == WRONG_KEY  # a comment is no key
    assert keys.describe().startswith(f"API keys required: 3 API keys ($BATON_API_KEYS + {api_file}), 1 admin key")


def test_an_unreadable_key_file_is_named_and_its_bytes_are_not(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read the API key file .*missing: No such file or directory"):
        ApiKeys.from_config(AuthConfig(api_keys_file=str(tmp_path / "missing")), {})
    binary = tmp_path / "binary"
    binary.write_bytes(b"sk-\xff\xfe-secret")
    with pytest.raises(ValueError) as info:
        ApiKeys.from_config(AuthConfig(admin_api_keys_file=str(binary)), {})
    assert str(info.value) == f"cannot read the API key file {binary}: it is not UTF-8 text"
    assert info.value.__suppress_context__  # the decode error, which quotes bytes, is not shown


def test_without_keys_every_caller_is_anonymous_as_before():
    keys = ApiKeys.from_config(AuthConfig(), {})
    assert not keys.is_enabled
    for authorization in (None, "", "Bearer anything", "garbage"):
        assert keys.authenticate(authorization) is ANONYMOUS
    assert "no API keys configured" in keys.describe() and "open" in keys.describe()


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, MISSING_KEY),
        ("", MISSING_KEY),
        ("   ", MISSING_KEY),
        ("Bearer", MALFORMED_HEADER),
        ("Bearer   ", MALFORMED_HEADER),
        (f"Basic {KEY_A}", MALFORMED_HEADER),
        (KEY_A, MALFORMED_HEADER),
        ("Bearer sk-wrong", WRONG_KEY),
        (f"Bearer {KEY_A}x", WRONG_KEY),
        (f"Bearer {KEY_A[:-1]}", WRONG_KEY),
    ],
    ids=["none", "empty", "blank", "no-key", "blank-key", "basic", "no-scheme", "wrong", "longer", "shorter"],
)
def test_a_missing_malformed_or_wrong_key_is_refused_naming_no_key(keys, authorization, message):
    assert refusal(keys, authorization) == message
    status = status_of(UnauthenticatedError(message))
    assert (status.grpc_code.name, status.http_status, status.is_rejection) == ("UNAUTHENTICATED", 401, True)
    for secret in (KEY_A, KEY_B, ADMIN, "sk-"):
        assert secret not in message


def test_each_key_is_a_caller_known_by_its_fingerprint(keys):
    a, b, admin = (keys.authenticate(f"Bearer {k}") for k in (KEY_A, KEY_B, ADMIN))
    assert keys.authenticate(f"bearer  {KEY_A} ") == a  # the scheme in any case, spaces around the key
    assert len({a.owner, b.owner, admin.owner}) == 3
    for caller, key in ((a, KEY_A), (b, KEY_B), (admin, ADMIN)):
        assert caller.owner.startswith("key-") and len(caller.owner) == 16 and key not in caller.owner
    assert ApiKeys([KEY_A]).authenticate(f"Bearer {KEY_A}").owner == a.owner  # the same on every replica
    assert (a.is_admin, b.is_admin, admin.is_admin) == (False, False, True)


def test_who_may_abort_whose_request(keys):
    a, b, admin = (keys.authenticate(f"Bearer {k}") for k in (KEY_A, KEY_B, ADMIN))
    assert a.may_act_on(a.owner) and not a.may_act_on(b.owner) and not a.may_act_on(None)
    assert admin.may_act_on(a.owner) and admin.may_act_on(b.owner)
    assert ANONYMOUS.may_act_on(None) and not ANONYMOUS.may_act_on(a.owner)
    assert Caller(owner=None) == ANONYMOUS


def test_every_key_is_compared_with_compare_digest_without_stopping_at_a_match(keys, monkeypatch):
    calls = []
    compare_digest = hmac.compare_digest

    def spy(left, right):
        calls.append((left, right))
        return compare_digest(left, right)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", spy)
    for key in (KEY_A, ADMIN, "sk-wrong"):
        calls.clear()
        with contextlib.suppress(UnauthenticatedError):
            keys.authenticate(f"Bearer {key}")
        assert len(calls) == 3, key  # both API keys and the admin key, whichever matched
        assert all(len(left) == len(right) == 32 for left, right in calls)  # SHA-256 digests: equal lengths
        assert all(key.encode() not in left for left, _ in calls)  # digests, not the key itself


def test_describe_counts_keys_and_never_shows_one(keys, tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n")
    described = ApiKeys.from_config(AuthConfig(api_keys_file=str(path), protect_health=True), {}).describe()
    assert described == f"API keys required: 1 API key ({path}); health checks need a key too"
    assert KEY_A not in described and KEY_A not in keys.describe()
