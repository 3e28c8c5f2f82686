"""kvservice.ops.access: who is an admin for GetStats, and what a scoped viewer is told."""

from __future__ import annotations

from kvservice.identity import CredentialBook, Identity
from kvservice.ops import AdminPolicy
from kvservice.sessions import Session
from tests.support.services import make_config


def _policy(**overrides) -> tuple[AdminPolicy, CredentialBook]:
    book = CredentialBook()
    cfg = make_config(**overrides)
    return AdminPolicy(cfg, book), book


def test_an_admin_session_is_admin() -> None:
    """A session opened by an admin uid sees the whole node."""
    policy, _ = _policy()
    v = policy.viewer(Session("s1", "ops", 0, Identity(0, 0, 1), admin=True))
    assert (v.admin, v.session_id, v.why) == (True, "s1", "session")


def test_a_credential_of_an_admin_uid_is_admin_once() -> None:
    """A credential of an admin uid makes the call admin; it is single-use; other uids are not."""
    policy, book = _policy(admin_uids="4242")
    token = book.issue(Identity(4242, 1, 1))
    assert policy.viewer(None, credential=token).why == "uid 4242"
    assert not policy.viewer(None, credential=token).admin
    assert not policy.viewer(None, credential=book.issue(Identity(777, 1, 1))).admin


def test_certificate_names_and_tokens_from_the_config() -> None:
    """admin_identities names and admin_token_file tokens are admin; others are not."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp()
    os.write(fd, b"ops-token\n")
    os.close(fd)
    policy, _ = _policy(admin_identities="ops-console, grafana", admin_token_file=path)
    assert policy.viewer(None, certificate="grafana").why == "certificate"
    assert not policy.viewer(None, certificate="engine").admin
    assert policy.viewer(None, bearer="Bearer ops-token").why == "token"
    assert not policy.viewer(None, bearer="Bearer engine-token").admin
    assert not policy.viewer(None, bearer="ops-token").admin  # not a bearer scheme
    os.unlink(path)


def test_the_scope_note_says_what_is_shown_and_how_to_see_all() -> None:
    """Scoped viewers get a note naming their scope and the three ways to be an admin."""
    policy, _ = _policy()
    anonymous = policy.viewer(None)
    mine = policy.viewer(Session("s2", "engine", 0))
    assert "none of 3" in anonymous.scope_note(3, 0)
    assert "this session's own (1 of 3)" in mine.scope_note(3, 1)
    for word in ("admin_uids", "admin_identities", "admin_token_file"):
        assert word in mine.scope_note(3, 1)
    assert policy.viewer(Session("s3", "ops", 0, admin=True)).scope_note(3, 3) == ""
    assert mine.sees("s2") and not mine.sees("other") and not anonymous.sees("")
