"""Content-Security-Policy (django-csp) on the admin and the portal, none on the API."""

import pytest
from django.test import Client

pytest_plugins = ["tests.admin_fixtures"]


def directives(response) -> dict[str, str]:
    header = response["Content-Security-Policy"]
    return {part.split(" ", 1)[0]: part.split(" ", 1)[1] for part in header.split("; ")}


@pytest.mark.parametrize("path", ["/admin/login/", "/portal/", "/portal/open/not-a-token"])
def test_html_pages_carry_a_strict_policy(db, path):
    response = Client().get(path)
    policy = directives(response)
    assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'" and policy["form-action"] == "'self'"
    assert "'unsafe-inline'" not in policy["script-src"] and "unsafe-eval" not in response["Content-Security-Policy"]


def test_signed_in_admin_pages_have_no_inline_scripts(tenant_a, staff_clients):
    _user, client = staff_clients["admin"]
    for path in ("/admin/", "/admin/memories/memory/", f"/admin/memories/tenant/{tenant_a.pk}/dashboard/"):
        response = client.get(path)
        assert response.status_code == 200 and "Content-Security-Policy" in response
        text = response.content.decode()
        assert " onclick=" not in text and " onload=" not in text
        # Every <script> is a file of this origin (no inline code for the policy to block).
        for tag in text.split("<script")[1:]:
            assert (
                tag.split(">", 1)[0].strip().startswith(("src=", 'id="django-admin')) or " src=" in tag.split(">", 1)[0]
            ), tag[:120]


def test_the_api_is_left_out(api):
    assert "Content-Security-Policy" not in api.get("/api/v1/memories")
    assert "Content-Security-Policy" not in Client().get("/healthz")
