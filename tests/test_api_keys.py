"""serve_app/api_keys.py: which Authorization values the router lets through, and how the
key file is read and read again."""

from __future__ import annotations

import os

import pytest

from serve_app.api_keys import ApiKeys, Unauthenticated, authorization
from serve_app.errors import public_error


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-11\nold-key\n\n  new-key  \n")
    return path


@pytest.mark.parametrize("header", ["Bearer old-key", "Bearer new-key", "bearer new-key  "])
def test_each_key_of_the_file_is_accepted(key_file, header):
    ApiKeys(key_file).check(header)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("Bearer", "missing API key"),
        ("Bearer ", "missing API key"),
        ("Basic old-key", "missing API key"),
        ("old-key", "missing API key"),
        ("Bearer old-ke", "invalid API key"),
        ("Bearer # rotated 2026-11", "invalid API key"),  # a comment is not a key
        ("Bearer old-key new-key", "invalid API key"),
    ],
)
def test_anything_else_is_unauthenticated(key_file, header, message):
    with pytest.raises(Unauthenticated, match=message):
        ApiKeys(key_file).check(header)


def test_the_client_is_told_it_is_unauthenticated_not_that_the_service_failed():
    kind, message = public_error(Unauthenticated("invalid API key"))
    assert (kind, message) == ("unauthenticated", "invalid API key")


def test_a_changed_file_is_read_again(key_file):
    keys = ApiKeys(key_file)
    key_file.write_text("newest-key\n")
    keys.check("Bearer newest-key")
    with pytest.raises(Unauthenticated):
        keys.check("Bearer old-key")


def test_a_file_emptied_or_removed_later_keeps_the_last_keys(key_file, caplog):
    keys = ApiKeys(key_file)
    key_file.write_text("\n")
    keys.check("Bearer old-key")
    assert "keeping the previous API keys" in caplog.text
    os.remove(key_file)
    keys.check("Bearer new-key")
    with pytest.raises(Unauthenticated):
        keys.check("Bearer other")


@pytest.mark.parametrize("text", [None, "", "\n# only a comment\n"])
def test_a_router_without_keys_refuses_to_start_open(tmp_path, text):
    path = tmp_path / "keys"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match="api_key_file .*keys"):
        ApiKeys(path)


def test_the_grpc_authorization_entry_is_found_among_the_metadata():
    meta = [("application", "baton"), ("authorization", b"Bearer k")]
    assert authorization(meta) == "Bearer k"
    assert authorization([("application", "baton")]) is None


def test_a_key_no_http_header_could_carry_is_refused_when_read(tmp_path):
    path = tmp_path / "keys"
    path.write_text("good-key\nclé-secrète\n")
    with pytest.raises(ValueError, match="key 2 holds characters other than printable ASCII"):
        ApiKeys(path)


def test_a_byte_order_mark_is_not_part_of_the_first_key(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes("\ufefffirst-key\n".encode())
    ApiKeys(path).check("Bearer first-key")


def test_a_kubernetes_secret_update_swaps_a_symlink_and_is_seen(tmp_path):
    # The kubelet writes a new ..<timestamp> folder and swaps the ..data link to it.
    old, new = tmp_path / "..2026_11_01", tmp_path / "..2026_11_02"
    for folder, key in ((old, "old-key"), (new, "new-key")):
        folder.mkdir()
        (folder / "keys").write_text(key + "\n")
    (tmp_path / "..data").symlink_to(old.name)
    (tmp_path / "keys").symlink_to("..data/keys")
    keys = ApiKeys(tmp_path / "keys")
    keys.check("Bearer old-key")
    swap = tmp_path / "..data_tmp"
    swap.symlink_to(new.name)
    swap.replace(tmp_path / "..data")
    keys.check("Bearer new-key")
    with pytest.raises(Unauthenticated):
        keys.check("Bearer old-key")


def test_the_key_file_must_be_an_absolute_path():
    from pydantic import ValidationError

    from serve_app.config import AppConfig

    assert AppConfig(api_key_file="/etc/baton/keys").api_key_file == "/etc/baton/keys"
    with pytest.raises(ValidationError, match="api_key_file must be an absolute path"):
        AppConfig(api_key_file="keys.txt")
