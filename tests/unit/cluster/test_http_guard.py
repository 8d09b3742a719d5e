"""The checks the dashboard and the OpenAI endpoint share (`asyncrl.cluster.http_guard`), on header maps."""

import pytest

from asyncrl.cluster.http_guard import Guard, host_name, is_loopback

TOKEN = "t" * 32
OWN = {"Host": "127.0.0.1:8470", "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def test_loopback_names_and_host_headers():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "[::1]")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "::", "example.com", "")] == [False] * 5
    names = [host_name(h) for h in ("[::1]:8470", "Example.COM:80", "127.0.0.1", "::1")]
    assert names == ["::1", "example.com", "127.0.0.1", "::1"]


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({}, None),
        ({"Origin": "http://127.0.0.1:8470"}, None),
        ({"Content-Type": "application/json; charset=utf-8"}, None),
        ({"Host": "localhost:9000", "Origin": "http://localhost:9000"}, None),  # an SSH tunnel's port
        ({"Host": "evil.example:8470"}, 403),
        ({"Host": ""}, 400),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Origin": "http://127.0.0.1:8470.evil.example"}, 403),
        ({"Authorization": ""}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": ""}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ],
)
def test_a_post_is_refused_with_the_status_that_names_what_is_wrong(change, status):
    refusal = Guard("127.0.0.1", TOKEN).refusal("POST", {**OWN, **change})
    assert (refusal and int(refusal[0])) == status, refusal


def test_the_page_opens_with_the_token_in_its_address_and_reads_need_no_content_type():
    guard = Guard("127.0.0.1", TOKEN)
    assert guard.refusal("GET", {"Host": "localhost:8470"}, query_token=TOKEN) is None
    assert guard.refusal("GET", {"Host": "localhost:8470"}, query_token="nope")[0] == 401
    assert guard.refusal("GET", {"Host": "localhost:8470"})[0] == 401


def test_without_a_secret_only_loopback_binds_and_wildcards_accept_any_host():
    assert Guard("127.0.0.1", "").refusal("POST", {"Host": "127.0.0.1:1", "Content-Type": "application/json"}) is None
    with pytest.raises(ValueError, match="beyond loopback"):
        Guard("0.0.0.0", "")
    wildcard = Guard("0.0.0.0", TOKEN)
    assert wildcard.known_hosts() is None and wildcard.refusal("POST", {**OWN, "Host": "10.1.2.3:8470"}) is None
    assert wildcard.refusal("POST", {**OWN, "Host": "10.1.2.3:8470", "Authorization": ""})[0] == 401
    assert Guard("10.1.2.3", TOKEN).refusal("POST", {**OWN, "Host": "evil.example"})[0] == 403
