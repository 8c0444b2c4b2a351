"""The registry client's status check: a success's body is never parsed, an error's body is read defensively.

These are real ``requests.Response`` objects (the body given as bytes), the shapes a registry or a proxy in front
of one can answer with; the round trips through the real registry are in test_push_pull / test_pull_built_example.
"""

from __future__ import annotations

import io
import json

import pytest
import requests

from model_factory.distribution import registry as reg
from model_factory.errors import FactoryError


def _response(status: int, body: bytes, stream: bool = False) -> requests.Response:
    r = requests.Response()
    r.status_code = status
    if stream:
        r.raw = io.BytesIO(body)
    else:
        r._content = body
    return r


class _Body:
    """A body that fails the test if anything reads it (a blob the check must leave to the download loop)."""

    def read(self, *_a, **_k):
        raise AssertionError("a successful response's body was read by the status check")

    stream = read


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b'"text"', b"null", b"{}", b"not json", b"\xff\xfe",
                                  json.dumps({"errors": "oops"}).encode(), json.dumps({"errors": [1, "x"]}).encode()])
def test_odd_error_bodies_give_one_line_not_a_crash(body):
    for status in (400, 404, 500):
        r = _response(status, body)
        assert reg._codes(r) == set()
        assert "\n" not in reg._errors_of(r)


def test_error_codes_and_messages_are_read_from_a_registry_error_document():
    doc = {"errors": [{"code": "NAME_UNKNOWN", "message": "repository name not known"}, "junk"]}
    r = _response(404, json.dumps(doc).encode(), stream=True)
    assert reg._codes(r) == {"NAME_UNKNOWN"}
    assert reg._errors_of(r) == "NAME_UNKNOWN: repository name not known"  # read once, remembered


def test_a_successful_body_is_never_read_by_the_check():
    r = requests.Response()
    r.status_code, r.raw = 200, _Body()
    assert reg._codes(r) == set() and reg._errors_of(r) == ""
    target = object.__new__(reg.RegistryTarget)  # _check needs only the reference and the config's name
    target.ref, target.label, target._config = reg.parse_registry_ref("oci://127.0.0.1:1/a/b:1"), "oci://x", None
    assert target._check(r, "downloading") is r


def test_a_huge_error_body_is_read_only_up_to_a_bound():
    r = _response(500, b"x" * (10 << 20), stream=True)
    assert len(reg._error_body(r)) == reg._ERROR_BODY_MAX
    assert len(reg._errors_of(r)) <= 200


def test_a_refusal_still_names_the_fix():
    target = object.__new__(reg.RegistryTarget)
    target.ref, target.label, target._config = reg.parse_registry_ref("oci://127.0.0.1:1/a/b:1"), "oci://x", None
    with pytest.raises(FactoryError, match="refused access.*Fix"):
        target._check(_response(401, b"[]"), "downloading")
