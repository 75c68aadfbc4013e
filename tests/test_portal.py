"""The end-user portal: portal links (POST /api/v1/subjects/{subject}/portal-link) and the
pages they open — what is remembered about the end user, forgetting one memory or all of
them, the request's progress and receipt. Real database; only the clock is faked."""

import re
from datetime import timedelta
from urllib.parse import urlparse

import pytest
from django.test import Client
from django.utils import timezone

from audit import chain
from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, Memory
from memories.portal.models import PortalLink
from memories.portal.views import COOKIE
from memories.services import forget, subjects
from tests.factories import SYSTEM, logged_in, make_staff
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden
from zeromem.kernel.scopes import Scope

CANARY_U1 = "CANARY-u1-value-3b7e"
CANARY_U2 = "CANARY-u2-value-9d1c"
CANARY_B = "CANARY-globex-u1-5a02"


@pytest.fixture
def seeded(tenant_a, tenant_b):
    """Tenant A: end users u1 (three memories) and u2; tenant B: its own u1."""
    write = services.memory_write
    write(tenant=tenant_a, actor=SYSTEM, key="user:u1:pref_lang", value=f"Chinese {CANARY_U1}")
    write(
        tenant=tenant_a,
        actor=SYSTEM,
        key="user:u1:shipping_addr",
        value={"city": "Lyon", "postCode": "69001", "tags": ["home", "weekdays"]},
    )
    write(tenant=tenant_a, actor=SYSTEM, key="task:t9:status", value={"done": True}, subject="u1", ttl_seconds=3600)
    write(tenant=tenant_a, actor=SYSTEM, key="user:u2:pref_lang", value=f"French {CANARY_U2}")
    write(tenant=tenant_b, actor=SYSTEM, key="user:u1:pref_lang", value=f"Esperanto {CANARY_B}")
    return tenant_a, tenant_b


def issue(api, subject="u1"):
    r = api.post(f"/api/v1/subjects/{subject}/portal-link")
    assert r.status_code == 201, r.content
    return r.json()


def path_of(url: str) -> str:
    return urlparse(url).path


def open_portal(url: str, client=None) -> Client:
    """A browser-like client that opened the link (landing page, then Continue)."""
    client = client or Client(enforce_csrf_checks=True)
    landing = client.get(path_of(url))
    assert landing.status_code == 200, landing.content
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', landing.content.decode()).group(1)
    r = client.post(path_of(url), {"csrfmiddlewaretoken": token})
    assert r.status_code == 302 and r["Location"] == "/portal/", r.content
    return client


def csrf(client) -> str:
    page = client.get("/portal/")
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)


def forget_post(client, data, callbacks):
    with callbacks(execute=True):
        return client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), **data})


def page_text(response) -> str:
    return response.content.decode()


# --- issuing links -------------------------------------------------------------------------


def test_portal_link_answers_a_url_and_its_expiry(api, tenant_a, settings, monkeypatch):
    settings.ZEROMEM_PORTAL_LINK_SECONDS = 600
    before = timezone.now().replace(microsecond=0)
    monkeypatch.setattr(timezone, "now", lambda: before)  # a fixed clock: no slack needed
    body = issue(api)
    assert set(body) == {"url", "expires_at"}
    assert body["url"].startswith("http://testserver/portal/open/")
    link = PortalLink.objects.get()
    assert (link.tenant, link.subject, link.opened_at) == (tenant_a, "u1", None)
    assert link.expires_at - before == timedelta(seconds=600)
    assert body["expires_at"].startswith(link.expires_at.strftime("%Y-%m-%dT%H:%M:%S"))
    event = AuditEvent.objects.get(action="portal.link_create")
    assert (event.actor_kind, event.subject, event.outcome) == ("api_key", "u1", "ok")
    assert urlparse(body["url"]).path.rsplit("/", 1)[-1] not in str(event.detail)  # the token is not logged


def test_portal_link_is_built_on_the_public_url_when_set(api, seeded, settings):
    settings.ZEROMEM_PUBLIC_URL = "https://memory.example.com"
    assert issue(api)["url"].startswith("https://memory.example.com/portal/open/")


def test_portal_link_needs_the_forget_create_scope(tenant_a, make_client):
    client, _ = make_client(tenant_a, scopes=[s for s in Scope.values if s != Scope.FORGET_CREATE])
    r = client.post("/api/v1/subjects/u1/portal-link")
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"
    assert not PortalLink.objects.exists()
    assert AuditEvent.objects.get(action="portal.link_create").outcome == "denied"


def test_portal_link_is_refused_to_a_key_limited_to_some_prefixes(tenant_a, make_client):
    client, _ = make_client(tenant_a, allow=["user:u1:"])
    r = client.post("/api/v1/subjects/u1/portal-link")
    assert r.status_code == 403 and r.json()["error"] == {
        "code": "key_not_allowed",
        "message": "an API key limited to some prefixes cannot open a subject's whole portal",
        "field": "subject",
    }
    assert not PortalLink.objects.exists()


def test_portal_link_for_a_too_long_subject_is_400_naming_the_field(api):
    r = api.post(f"/api/v1/subjects/{'u' * 256}/portal-link")
    assert r.status_code == 400 and r.json()["error"]["field"] == "subject"
    assert not PortalLink.objects.exists()


# --- opening links -------------------------------------------------------------------------


def test_looking_at_a_link_does_not_use_it_up(api, seeded):
    url = issue(api)["url"]
    client = Client()
    for _ in range(2):  # e.g. a chat app's link preview, then the user
        r = client.get(path_of(url))
        assert r.status_code == 200 and "Continue to my page" in page_text(r)
        assert r["Cache-Control"].startswith("max-age=0") and r["Referrer-Policy"] == "same-origin"
    assert PortalLink.objects.get().opened_at is None
    assert COOKIE not in client.cookies


def test_a_link_opens_once_and_is_then_refused_as_replayed(api, seeded):
    url = issue(api)["url"]
    first = open_portal(url)
    assert first.cookies[COOKIE]["httponly"] and first.cookies[COOKIE]["path"] == "/portal/"
    assert PortalLink.objects.get().opened_at is not None

    for method in ("get", "post"):
        again = getattr(Client(), method)(path_of(url))
        assert again.status_code == 410
        assert "This link has already been used" in page_text(again)
        assert COOKIE not in again.cookies
    refused = AuditEvent.objects.filter(action="portal.open", outcome="denied")
    assert [e.detail["code"] for e in refused] == ["link_replayed", "link_replayed"]
    assert all(e.actor_kind == "anonymous" and e.subject == "u1" for e in refused)
    # The first browser still has its page.
    assert first.get("/portal/").status_code == 200


def test_the_same_browser_opening_a_used_link_is_pointed_to_its_open_page(api, seeded):
    url = issue(api)["url"]
    client = open_portal(url)
    r = client.get(path_of(url))
    assert r.status_code == 410 and 'href="/portal/"' in page_text(r)


def test_an_expired_link_is_refused_with_410(api, seeded, settings, monkeypatch):
    settings.ZEROMEM_PORTAL_LINK_SECONDS = 60
    url = issue(api)["url"]
    later = timezone.now() + timedelta(seconds=61)
    monkeypatch.setattr(timezone, "now", lambda: later)
    for method in ("get", "post"):
        r = getattr(Client(), method)(path_of(url))
        assert r.status_code == 410 and "This link has expired" in page_text(r)
    assert PortalLink.objects.get().opened_at is None
    assert AuditEvent.objects.filter(action="portal.open", detail__code="link_expired").count() == 2


@pytest.mark.parametrize(
    "alter",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # one character changed
        lambda t: t[:-6],  # truncated
        lambda t: "x" + t,  # prefixed
        lambda t: "not-a-token",
        lambda t: t * 3,  # longer than any token
    ],
    ids=["changed", "truncated", "prefixed", "made_up", "too_long"],
)
def test_an_altered_link_is_refused_with_400(api, seeded, alter):
    url = issue(api)["url"]
    token = path_of(url).rsplit("/", 1)[-1]
    for method in ("get", "post"):
        r = getattr(Client(), method)(f"/portal/open/{alter(token)}")
        assert r.status_code == 400 and "This link does not work" in page_text(r)
        assert "Traceback" not in page_text(r)
    assert PortalLink.objects.get().opened_at is None
    assert AuditEvent.objects.filter(action="portal.open", outcome="invalid", detail__code="link_altered").count() == 2


def test_trying_made_up_links_is_throttled_per_address_and_then_writes_nothing(api, seeded, settings, limiter_minute):
    # Anyone may try tokens: each refusal was one audit row, without end, in a log nothing
    # may delete. Past the failed-authentication limit of the address: 429, nothing written.
    settings.ZEROMEM_AUTH_FAILURES_PER_MINUTE = 5
    url = issue(api)["url"]
    tries = [Client(REMOTE_ADDR="203.0.113.9").get(f"/portal/open/made-up-{i}") for i in range(8)]
    assert [r.status_code for r in tries] == [400] * 5 + [429] * 3
    assert "Too many attempts" in page_text(tries[-1]) and int(tries[-1]["Retry-After"]) >= 1
    assert AuditEvent.objects.filter(action="portal.open", detail__code="link_altered").count() == 5
    # Another address is not held up, and a good link opens from the throttled one too.
    assert Client(REMOTE_ADDR="198.51.100.7").get("/portal/open/made-up").status_code == 400
    assert (
        open_portal(url, Client(enforce_csrf_checks=True, REMOTE_ADDR="203.0.113.9")).get("/portal/").status_code == 200
    )


def test_a_portal_session_loading_pages_past_its_limit_gets_429_and_writes_nothing(
    api, seeded, settings, limiter_minute
):
    """Each page of a session is an audit row of the tenant's, and a session lasts half an
    hour: past ZEROMEM_PORTAL_PAGES_PER_MINUTE its pages are a 429 (nothing read or written);
    another session is not held up, and signing out still works."""
    settings.ZEROMEM_PORTAL_PAGES_PER_MINUTE = 4
    session = open_portal(issue(api)["url"])
    other = open_portal(issue(api, "u2")["url"])
    token = csrf(session)  # the first page
    pages = [session.get("/portal/").status_code for _ in range(5)]
    assert pages == [200] * 3 + [429] * 2
    events = AuditEvent.objects.count()
    refused = session.post("/portal/forget", {"csrfmiddlewaretoken": token, "what": "all", "confirm": "yes"})
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert "Too many attempts" in page_text(refused)
    assert AuditEvent.objects.count() == events and not ForgetRequest.objects.exists()
    assert other.get("/portal/").status_code == 200
    assert session.post("/portal/sign-out", {"csrfmiddlewaretoken": token}).status_code == 200
    assert AuditEvent.objects.filter(action="portal.sign_out").count() == 1


def test_a_link_is_an_opaque_random_token_stored_only_as_its_hash(api, api_b, seeded):
    """The URL names no tenant and no subject, and the database never holds the token."""
    import hashlib

    tokens = [
        path_of(issue(client, subject)["url"]).rsplit("/", 1)[-1]
        for client, subject in ((api, "u1"), (api, "u1"), (api_b, "u1"))
    ]
    assert len(set(tokens)) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]{43}", t) for t in tokens), tokens
    # Each is 32 random bytes, base64url: nothing of the tenant or the subject is in it (a
    # substring check would fail by chance on a random token, ~1% of runs for "u1").
    import base64

    assert all(len(base64.urlsafe_b64decode(t + "=")) == 32 for t in tokens)
    rows = list(PortalLink.objects.order_by("pk").values())
    assert [r["token_hash"] for r in rows] == [hashlib.sha256(t.encode()).hexdigest() for t in tokens]
    assert not any(t in str(rows) for t in tokens)
    assert not any(t in str(list(AuditEvent.objects.values())) for t in tokens)
    # Each opens its own tenant's page: the tenant and subject come from the row.
    assert CANARY_B in page_text(open_portal(f"/portal/open/{tokens[2]}").get("/portal/"))


@pytest.mark.postgres  # (SQLite's in-memory test database is one connection: no real race)
def test_a_link_opened_twice_at_once_is_won_by_exactly_one(api, seeded, transactional_db):
    """Two requests open the same link at the same moment (threads, each with its own
    database connection, released together by a barrier): one session, one refusal."""
    import threading

    from django.db import connection

    from memories.portal.services import LinkRefused, portal_link_open

    token = path_of(issue(api)["url"]).rsplit("/", 1)[-1]
    barrier, outcomes = threading.Barrier(2), []

    def open_it():
        try:
            barrier.wait()
            portal_link_open(token=token, actor_for=lambda _link: SYSTEM, use=True)
            outcomes.append("opened")
        except LinkRefused as exc:
            outcomes.append(exc.reason)
        finally:
            connection.close()

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["opened", "replayed"], outcomes
    assert AuditEvent.objects.filter(action="portal.open", outcome="ok").count() == 1
    assert AuditEvent.objects.filter(action="portal.open", detail__code="link_replayed").count() == 1


# --- withdrawing links ---------------------------------------------------------------------


def test_the_tenant_withdraws_a_subjects_links_and_open_sessions(api, api_b, seeded):
    unopened = issue(api)["url"]
    session = open_portal(issue(api)["url"])
    other_tenant = open_portal(issue(api_b)["url"])
    assert session.get("/portal/").status_code == 200

    r = api.delete("/api/v1/subjects/u1/portal-link")
    assert r.status_code == 200 and r.json() == {"revoked": 2}
    for method in ("get", "post"):
        refused = getattr(Client(), method)(path_of(unopened))
        assert refused.status_code == 410 and "This link was withdrawn" in page_text(refused)
    assert session.get("/portal/").status_code == 403  # the open session ended
    assert other_tenant.get("/portal/").status_code == 200  # tenant B's u1 is not touched
    event = AuditEvent.objects.get(action="portal.revoke")
    assert (event.subject, event.count, event.outcome) == ("u1", 2, "ok")
    assert api.delete("/api/v1/subjects/u1/portal-link").json() == {"revoked": 0}


def test_withdrawing_links_needs_the_same_rights_as_issuing_them(api, tenant_a, make_client):
    issue(api)
    limited, _ = make_client(tenant_a, allow=["user:u1:"])
    r = limited.delete("/api/v1/subjects/u1/portal-link")
    assert r.status_code == 403 and r.json()["error"]["code"] == "key_not_allowed"
    no_scope, _ = make_client(tenant_a, scopes=[s for s in Scope.values if s != Scope.FORGET_CREATE])
    assert no_scope.delete("/api/v1/subjects/u1/portal-link").json()["error"]["code"] == "missing_scope"
    assert PortalLink.objects.get().revoked_at is None


def test_revoking_the_issuing_key_withdraws_its_links_and_sessions(tenant_a, make_client, seeded):
    issuer, key = make_client(tenant_a)
    other, _ = make_client(tenant_a)
    unopened = issue(issuer)["url"]
    session = open_portal(issue(issuer)["url"])
    kept = open_portal(issue(other)["url"])  # issued by another key: stays
    services.api_key_revoke(tenant=tenant_a, actor=SYSTEM, key_id=key.pk)
    assert Client().get(path_of(unopened)).status_code == 410
    assert session.get("/portal/").status_code == 403
    assert kept.get("/portal/").status_code == 200
    event = AuditEvent.objects.filter(action="api_key.revoke").get()
    assert event.detail == {"portal_links_revoked": 2}


def test_the_issuing_keys_expiry_withdraws_its_links_and_sessions(tenant_a, make_client, seeded, settings, monkeypatch):
    """A revoked key withdrew its links; an expired one did not: they opened until their own
    expiry (an hour), and the sessions they opened lasted on. A link now expires at the
    earlier of its own expiry and its key's (the answer says so), and a session it opened
    ends when the key expires. Only the clock is faked."""
    settings.ZEROMEM_PORTAL_LINK_SECONDS = 3600
    start = timezone.now().replace(microsecond=0)
    monkeypatch.setattr(timezone, "now", lambda: start)
    issuer, key = make_client(tenant_a)
    key.expires_at = start + timedelta(minutes=10)  # a key issued to expire in ten minutes
    key.save(update_fields=["expires_at"])
    other, _ = make_client(tenant_a)  # no expiry
    body = issue(issuer)
    unopened = body["url"]
    assert body["expires_at"].startswith(key.expires_at.strftime("%Y-%m-%dT%H:%M:%S"))
    session = open_portal(issue(issuer)["url"])
    kept = open_portal(issue(other)["url"])
    late = issue(other)["url"]  # not opened yet, by the key with no expiry
    assert session.get("/portal/").status_code == 200

    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(minutes=10, seconds=1))
    for method in ("get", "post"):
        r = getattr(Client(), method)(path_of(unopened))
        assert r.status_code == 410 and "This link has expired" in page_text(r)
    assert session.get("/portal/").status_code == 403
    assert kept.get("/portal/").status_code == 200
    assert open_portal(late).get("/portal/").status_code == 200
    refused = AuditEvent.objects.filter(action="portal.open", detail__code="link_expired")
    assert refused.count() == 2


def test_staff_withdraw_a_subjects_links_and_sessions_from_the_admin(api, api_b, seeded, tenant_a):
    """The admin's portal-link list and its "withdraw" action (memories/admin/portal_links.py),
    through portal_links_revoke: for the roles with forget:create, never for a viewer."""
    unopened, opened = issue(api)["url"], issue(api)["url"]
    session = open_portal(opened)
    kept = open_portal(issue(api, subject="u2")["url"])
    other_tenant = open_portal(issue(api_b)["url"])
    links = PortalLink.objects.filter(tenant=tenant_a, subject="u1")
    withdraw = {"action": "withdraw", "_selected_action": [str(links.first().pk)], "index": "0"}
    viewer, support = make_staff(tenant_a, "viewer"), make_staff(tenant_a, "support")

    page = logged_in(viewer).get("/admin/portal/portallink/")
    assert page.status_code == 200
    assert page_text(page).count('class="field-subject">u1<') == 2  # its two links...
    assert not any(path_of(url).rsplit("/", 1)[-1] in page_text(page) for url in (unopened, opened))  # no token
    assert '<option value="withdraw"' not in page_text(page)
    # no such action for a viewer: the list has none, and a POST that runs none is a 400
    assert logged_in(viewer).post("/admin/portal/portallink/", withdraw).status_code == 400
    assert not links.filter(revoked_at__isnull=False).exists()

    staff = logged_in(support)
    assert '<option value="withdraw"' in page_text(staff.get("/admin/portal/portallink/"))
    r = staff.post("/admin/portal/portallink/", withdraw, follow=True)
    assert r.redirect_chain == [("/admin/portal/portallink/", 302)]
    assert "2 portal links withdrawn for 1 end users." in page_text(r)
    assert page_text(r).count("withdrawn</td>") == 2
    assert Client().get(path_of(unopened)).status_code == 410
    assert session.get("/portal/").status_code == 403  # the open session ended
    assert kept.get("/portal/").status_code == 200  # u2's link is not touched
    assert other_tenant.get("/portal/").status_code == 200  # nor tenant B's u1
    event = AuditEvent.objects.get(action="portal.revoke")
    assert (event.actor_kind, event.actor_id, event.subject, event.count) == ("staff", str(support.pk), "u1", 2)


def test_withdrawing_every_link_of_a_long_list_works_through_a_bounded_batch_per_run(
    api, seeded, tenant_a, monkeypatch
):
    # "Select all" handed the action every link in scope: one audited service call per end
    # user, all in one request (links live an hour: tens of thousands for a busy app).
    from zeromem.kit import admin as kit_admin

    monkeypatch.setattr(kit_admin, "ACTION_MAX", 2)
    for subject in ("u1", "u2", "u3"):
        issue(api, subject=subject)
    staff = logged_in(make_staff(tenant_a, "support"))
    everything = {"action": "withdraw", "select_across": "1", "index": "0", "_selected_action": ["1"]}

    def run():
        return page_text(staff.post("/admin/portal/portallink/", everything, follow=True))

    first = run()
    assert "at most 2 end users per run" in first and "2 portal links withdrawn for 2 end users." in first
    assert PortalLink.objects.filter(tenant=tenant_a, revoked_at__isnull=True).count() == 1
    second = run()
    assert "at most 2" not in second and "1 portal links withdrawn for 1 end users." in second
    assert not PortalLink.objects.filter(tenant=tenant_a, revoked_at__isnull=True).exists()
    assert AuditEvent.objects.filter(tenant=tenant_a, action="portal.revoke").count() == 3  # none twice


def test_the_admin_finds_an_end_users_portal_links_by_the_whole_subject_through_its_index(api, seeded, tenant_a):
    # Django's "=subject" is iexact: UPPER(subject) = UPPER('u1'), which no index serves and
    # which also found "U1"'s links.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    issue(api, subject="u1")
    issue(api, subject="U1")
    with CaptureQueriesContext(connection) as queries:
        page = logged_in(make_staff(tenant_a, "support")).get("/admin/portal/portallink/?q=u1")
    assert page_text(page).count('class="field-subject">u1<') == 1
    assert 'class="field-subject">U1<' not in page_text(page)
    listing = [q["sql"] for q in queries if 'FROM "portal_portallink"' in q["sql"]]
    assert listing and all("UPPER(" not in sql for sql in listing), listing


def test_reading_the_admins_portal_link_list_is_audited_in_each_tenant_it_shows(api, api_b, seeded, tenant_a, tenant_b):
    # The list names end users (subject), when each was sent a link and opened the portal; its
    # search finds whether one end user ever was. Both were read without an audit event (the
    # forget queue's page and search record forget.list).
    issue(api, subject="u1")
    issue(api, subject="u1")
    issue(api, subject="u2")
    issue(api_b, subject="u1")
    viewer = make_staff(tenant_a, "viewer")
    client = logged_in(viewer)
    readings = AuditEvent.objects.filter(action="portal.list").order_by("pk")

    assert client.get("/admin/portal/portallink/?q=u1").status_code == 200
    assert client.get("/admin/portal/portallink/").status_code == 200
    assert client.get("/admin/portal/portallink/?q=nobody").status_code == 200
    got = [(e.tenant_id, e.actor_kind, e.actor_id, e.surface, e.subject, e.count, e.outcome) for e in readings]
    assert got == [
        (tenant_a.pk, "staff", str(viewer.pk), "admin", "u1", 2, "ok"),
        (tenant_a.pk, "staff", str(viewer.pk), "admin", "", 3, "ok"),
        (tenant_a.pk, "staff", str(viewer.pk), "admin", "nobody", 0, "ok"),
    ]
    assert not AuditEvent.objects.filter(tenant=tenant_b, action="portal.list").exists()
    # A withdrawal (a POST answered by a redirect) records its own portal.revoke, no reading.
    withdraw = {
        "action": "withdraw",
        "_selected_action": [str(PortalLink.objects.filter(tenant=tenant_a).first().pk)],
        "index": "0",
    }
    logged_in(make_staff(tenant_a, "support")).post("/admin/portal/portallink/", withdraw)
    assert readings.count() == 3


def test_log_lines_of_portal_paths_carry_no_token(api, seeded, caplog):
    """Django's 4xx line and the server's access-log record (granian hands the path as an
    argument) are written without the token."""
    import logging

    from zeromem.kit.logs import RedactPortalTokens, install_on_access_logs

    token = path_of(issue(api)["url"]).rsplit("/", 1)[-1]
    with caplog.at_level(logging.INFO):
        open_portal(f"/portal/open/{token}")
        Client().get(f"/portal/open/{token}")  # 410: logged by django.request
        install_on_access_logs()
        access = logging.getLogger("granian.access")
        access.info(
            '%(addr)s "%(method)s %(path)s" %(status)d',
            {"addr": "10.0.0.1", "method": "GET", "path": f"/portal/open/{token}", "status": 200},
        )
    lines = [r.getMessage() for r in caplog.records]
    assert any("Gone: /portal/open/…" in line for line in lines), lines
    assert any('"GET /portal/open/…" 200' in line for line in lines), lines
    assert not any(token in line for line in lines)
    assert any(isinstance(f, RedactPortalTokens) for f in access.filters)


def test_a_continue_refused_by_the_csrf_check_is_logged_without_the_token(api, seeded, caplog):
    """The landing page's button posts to /portal/open/<token>; a POST that fails Django's CSRF
    check (no cookie, a proxy's Origin not trusted) is logged by ``django.security.csrf`` with
    the path — redacted at that logger, so no handler (Django's DEBUG console, an error
    tracker's) gets a link that still opens."""
    import logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    token = path_of(issue(api)["url"]).rsplit("/", 1)[-1]
    # A handler on Django's own logger sees a record before the console handler at the root
    # (whose filter also redacts) does: as Django's DEBUG console handler on "django" does.
    kept = Keep()
    django_logger = logging.getLogger("django")
    django_logger.addHandler(kept)
    try:
        with caplog.at_level(logging.INFO):
            response = Client(enforce_csrf_checks=True).post(f"/portal/open/{token}")
    finally:
        django_logger.removeHandler(kept)
    assert response.status_code == 403
    assert kept.lines and all("/portal/open/…" in line for line in kept.lines), kept.lines
    assert not any(token in r.getMessage() for r in caplog.records)


# --- the page ------------------------------------------------------------------------------


def test_the_page_lists_the_subjects_memories_in_plain_words(api, seeded):
    client = open_portal(issue(api)["url"])
    r = client.get("/portal/")
    text = page_text(r)
    assert r.status_code == 200 and r["Cache-Control"].startswith("max-age=0")
    assert 'name="viewport"' in text and "<script" not in text and "http" not in text.split("<body>")[1]
    assert text.count('class="card memory"') == 3
    assert "Preferred language" in text and CANARY_U1 in text
    assert "Shipping address" in text and "<dt>City</dt><dd>Lyon</dd>" in text and "Post code" in text
    assert "home, weekdays" in text  # a list of words, not JSON
    assert "A task" in text and "<dt>Done</dt><dd>Yes</dd>" in text and "Forgotten automatically on" in text
    assert "Kept until you or the app remove it." in text


def test_the_page_shows_no_other_subjects_or_tenants_memories(api, api_b, seeded):
    text = page_text(open_portal(issue(api)["url"]).get("/portal/"))
    assert CANARY_U1 in text and CANARY_U2 not in text and CANARY_B not in text
    # Tenant B's u1 sees only tenant B's memory of u1.
    text_b = page_text(open_portal(issue(api_b)["url"]).get("/portal/"))
    assert CANARY_B in text_b and CANARY_U1 not in text_b and CANARY_U2 not in text_b


def test_each_card_shows_which_source_wrote_the_memory(api, tenant_a):
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:a", value="x", source="support-bot")
    api.call("memory_write", key="user:u1:b", value="y")  # no source given: the writing key's label
    text = page_text(open_portal(issue(api)["url"]).get("/portal/"))
    assert 'by <span class="source">support-bot</span>' in text
    assert f'by <span class="source">{api.raw_key[:12]}' in text, text[text.find("by <span") :][:200]


def test_values_are_escaped_on_the_page(api, tenant_a):
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:note", value={"<b>x</b>": "<script>1</script>"})
    text = page_text(open_portal(issue(api)["url"]).get("/portal/"))
    assert "<script>1</script>" not in text and "&lt;script&gt;1&lt;/script&gt;" in text
    assert "<b>x</b>" not in text


def test_an_expired_memory_is_not_listed(api, tenant_a):
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="user:u1:brief", value="gone soon", ttl_seconds=1)
    Memory.objects.filter(key="user:u1:brief").update(expires_at=timezone.now() - timedelta(seconds=1))
    text = page_text(open_portal(issue(api)["url"]).get("/portal/"))
    assert "gone soon" not in text and "Nothing is remembered about you right now." in text


NEXT = re.compile(r'<a href="(/portal/\?start=\d+)">Next</a>')
SHOWN_KEYS = re.compile(r"Reference: <code>([^<]+)</code>")


def test_a_user_with_more_memories_than_a_page_sees_every_one_page_by_page(api, tenant_a):
    # The page listed the first 500 and said "Showing the first 500": the rest of a heavy
    # user's memories could not be seen at all (nor forgotten one by one).
    keys = [f"user:u1:k{i:03d}" for i in range(120)]
    Memory.objects.bulk_create(
        Memory(tenant=tenant_a, key=k, namespace="user", subject="u1", value=f"v{k}") for k in keys
    )
    client = open_portal(issue(api)["url"])
    seen, path, pages = [], "/portal/", []
    while path:
        text = page_text(client.get(path))
        pages.append(path)
        seen += SHOWN_KEYS.findall(text)
        assert "of 120." in text
        path = (m := NEXT.search(text)) and m.group(1).replace("&amp;", "&")
    assert seen == keys and pages == ["/portal/", "/portal/?start=50", "/portal/?start=100"]
    assert "Back to the first" in text and "Showing 101 to 120 of 120." in text
    events = AuditEvent.objects.filter(action="subject.memories", actor_kind="end_user").order_by("pk")
    assert [(e.count, e.detail) for e in events] == [
        (120, {"start": 0, "shown": 50}),
        (120, {"start": 50, "shown": 50}),
        (120, {"start": 100, "shown": 20}),
    ]


def test_a_later_page_with_a_pending_request_reloads_itself_there(api, tenant_a):
    Memory.objects.bulk_create(
        Memory(tenant=tenant_a, key=f"user:u1:k{i:03d}", namespace="user", subject="u1", value=i) for i in range(60)
    )
    client = open_portal(issue(api)["url"])
    client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": "user:u1:k000"})
    text = page_text(client.get("/portal/?start=50"))
    assert 'content="2; url=/portal/?start=50&amp;refresh=1"' in text
    assert SHOWN_KEYS.findall(text)[0] == "user:u1:k050"


def test_a_page_of_huge_values_stops_at_its_size_budget(api, tenant_a):
    # 500 values of 250 KB were one page of 125 MB of HTML, rendered in 8.3 s, every load.
    big = "y" * 250_000
    Memory.objects.bulk_create(
        Memory(tenant=tenant_a, key=f"user:u1:k{i:02d}", namespace="user", subject="u1", value=big) for i in range(10)
    )
    client = open_portal(issue(api)["url"])
    first = client.get("/portal/")
    assert len(first.content) < 1_100_000
    assert SHOWN_KEYS.findall(page_text(first)) == ["user:u1:k00", "user:u1:k01", "user:u1:k02"]
    assert NEXT.search(page_text(first)).group(1) == "/portal/?start=3"
    # One value over the budget is still shown whole: a page is never empty.
    Memory.objects.filter(key="user:u1:k03").update(value="z" * 1_200_000)
    text = page_text(client.get("/portal/?start=3"))
    assert SHOWN_KEYS.findall(text) == ["user:u1:k03"] and "z" * 1_200_000 in text


@pytest.mark.parametrize("start", ["x", "-1", "\u0663", "1\u0660", "9" * 40, "2147483648"])
def test_a_bad_page_start_is_400_naming_it_and_shows_nothing(api, seeded, start):
    client = open_portal(issue(api)["url"])
    r = client.get("/portal/", {"start": start})
    assert r.status_code == 400 and "start:" in page_text(r)
    assert CANARY_U1 not in page_text(r)
    assert not AuditEvent.objects.filter(action="subject.memories", outcome="ok").exists()


def test_a_page_start_past_the_end_shows_no_memories_and_a_way_back(api, seeded):
    client = open_portal(issue(api)["url"])
    text = page_text(client.get("/portal/?start=3"))
    assert "No more memories after the first 3." in text and "Back to the first" in text
    assert CANARY_U1 not in text and NEXT.search(text) is None


# --- forgetting ----------------------------------------------------------------------------


def test_forgetting_one_memory_erases_it_and_shows_the_receipt(api, seeded, django_capture_on_commit_callbacks):
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    r = forget_post(client, {"what": "one", "key": "user:u1:pref_lang"}, django_capture_on_commit_callbacks)
    assert r.status_code == 302
    request = ForgetRequest.objects.get()
    assert r["Location"] == f"/portal/requests/{request.uid}"
    assert (request.keys, request.requested_by_kind, request.requested_by) == (["user:u1:pref_lang"], "end_user", "u1")
    assert request.status == "completed"
    assert not Memory.objects.filter(tenant=tenant_a, key="user:u1:pref_lang").exists()
    assert Memory.objects.filter(tenant=tenant_a, subject="u1").count() == 2

    page = client.get(r["Location"])
    text = page_text(page)
    assert page.status_code == 200 and "One memory: Preferred language" in text
    assert "Receipt" in text and "<th>Memories erased</th><td>1</td>" in text
    assert "<th>Saved versions erased</th><td>1</td>" in text
    assert CANARY_U1 not in text and 'http-equiv="refresh"' not in text


def test_forgetting_everything_erases_only_this_subject_in_this_tenant(api, seeded, django_capture_on_commit_callbacks):
    tenant_a, tenant_b = seeded
    client = open_portal(issue(api)["url"])
    r = forget_post(client, {"what": "all", "confirm": "yes"}, django_capture_on_commit_callbacks)
    request = ForgetRequest.objects.get()
    assert r["Location"] == f"/portal/requests/{request.uid}"
    assert (request.subject, request.status, request.receipt["memories"]) == ("u1", "completed", 3)
    assert not Memory.objects.filter(tenant=tenant_a, subject="u1").exists()
    assert Memory.objects.filter(tenant=tenant_a, subject="u2").count() == 1
    assert Memory.objects.filter(tenant=tenant_b, subject="u1").count() == 1
    text = page_text(client.get(r["Location"]))
    assert "Everything remembered about you" in text and "<th>Memories erased</th><td>3</td>" in text
    home = page_text(client.get("/portal/"))
    assert "Nothing is remembered about you right now." in home and "Done" in home


def test_a_pending_request_page_refreshes_itself(api, seeded, django_capture_on_commit_callbacks):
    client = open_portal(issue(api)["url"])
    with django_capture_on_commit_callbacks(execute=False):  # the job has not run yet
        r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "all", "confirm": "yes"})
    text = page_text(client.get(r["Location"]))
    assert 'http-equiv="refresh"' in text and '<li class="done">Received</li>' in text
    assert '<li class="">Done</li>' in text and "Receipt" not in text


REFRESH = re.compile(r'<meta http-equiv="refresh" content="(\d+)(?:; url=([^"]+))?">')


def follow_refreshes(client, path: str, most: int = 100) -> tuple[list[int], str]:
    """Load ``path`` and every page its meta refresh leads to, as a tab left open would:
    (the interval of each refresh, the last page's text)."""
    intervals = []
    text = page_text(client.get(path))
    while (found := REFRESH.search(text)) and len(intervals) < most:
        intervals.append(int(found.group(1)))
        url = (found.group(2) or path).replace("&amp;", "&")  # no url: this page again
        assert path_of(url) == path, url
        text = page_text(client.get(url))
    return intervals, text


@pytest.mark.parametrize("page", ["request", "home"])
def test_a_pending_request_page_left_open_backs_off_then_stops_and_offers_a_link(
    api, seeded, django_capture_on_commit_callbacks, settings, page
):
    # It reloaded itself every 2 s for as long as the request was pending, and each load is
    # 2 audit rows: a tab left open while the workers were stalled wrote ~1,800 rows in 30 min.
    settings.ZEROMEM_PORTAL_PAGES_PER_MINUTE = 1000
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    with django_capture_on_commit_callbacks(execute=False):  # the job never runs
        r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "all", "confirm": "yes"})
    path = r["Location"] if page == "request" else "/portal/"
    before = AuditEvent.objects.filter(tenant=tenant_a).count()
    intervals, last = follow_refreshes(client, path)
    rows = AuditEvent.objects.filter(tenant=tenant_a).count() - before
    assert intervals == [2, 4, 8, 16, 32, 60, 60, 60, 60, 60], intervals  # 6 min 2 s of checking
    assert rows <= 2 * (len(intervals) + 1), rows
    assert "http-equiv" not in last and f'<a href="{path}">Check again</a>' in last, last
    assert ForgetRequest.objects.get().status == "received"
    # Check again starts over at 2 s; a counter out of range is the first load's.
    for query in ("", "?refresh=x", "?refresh=-1", "?refresh=" + "9" * 40):
        assert REFRESH.search(page_text(client.get(path + query))).group(1) == "2", query


@pytest.mark.parametrize("data", [{"what": "all", "confirm": "yes"}, {"what": "one", "key": "user:u1:pref_lang"}])
def test_asking_again_while_a_request_is_pending_leads_to_that_request(api, seeded, data):
    # A script replaying the session cookie cannot flood the tenant's queue: while the end
    # user's request for the same thing is pending, asking again files nothing new.
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    token = csrf(client)
    answers = [client.post("/portal/forget", {"csrfmiddlewaretoken": token, **data}) for _ in range(5)]
    (request,) = ForgetRequest.objects.filter(tenant=tenant_a)
    assert {(r.status_code, r["Location"]) for r in answers} == {(302, f"/portal/requests/{request.uid}")}
    created = AuditEvent.objects.filter(tenant=tenant_a, action="forget.create", actor_kind="end_user")
    assert created.count() == 5  # each ask is recorded; four of them name the pending request
    assert {e.detail["forget_request"] for e in created} == {str(request.uid)}


@pytest.mark.postgres  # (SQLite's in-memory test database is one connection: no real race)
@pytest.mark.parametrize("key", [None, "user:u1:pref_lang"], ids=["all", "one"])
def test_a_forget_submitted_twice_at_once_files_one_request(seeded, transactional_db, key):
    """A double click (two POSTs at the same moment: threads, each with its own database
    connection, released together by a barrier) files one request; both lead to it. The
    check for a pending request ran before, and outside, the transaction that files one, so
    both found none and both filed (two requests, two erasures queued)."""
    import threading

    from django.db import connection

    tenant_a, _ = seeded
    actor = Actor(
        kind="end_user", id="u1", label="end user", scopes=frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE})
    )
    barrier, outcomes = threading.Barrier(2), []

    def submit():
        try:
            barrier.wait()
            outcomes.append(subjects.subject_forget(tenant=tenant_a, actor=actor, subject="u1", key=key).pk)
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (request,) = ForgetRequest.objects.filter(tenant=tenant_a)
    assert outcomes == [request.pk, request.pk]


def test_forgetting_while_the_tenant_is_at_its_pending_forgets_cap_is_a_429_page_and_files_nothing(
    api, seeded, settings
):
    # The cap (ZEROMEM_TENANT_MAX_PENDING_FORGETS) counts the tenant's pending requests, the
    # portal's too: many end users' sessions must not fill the queue every tenant shares.
    tenant_a, _ = seeded
    settings.ZEROMEM_TENANT_MAX_PENDING_FORGETS = 1
    assert api.post("/api/v1/forget-requests", {"subject": "u2"}).status_code == 202
    client = open_portal(issue(api)["url"])
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "all", "confirm": "yes"})
    assert r.status_code == 429 and int(r["Retry-After"]) >= 1
    assert "try again" in page_text(r).lower()
    assert ForgetRequest.objects.filter(tenant=tenant_a).count() == 1


def test_asking_again_after_the_request_was_carried_out_files_a_new_one(
    api, seeded, django_capture_on_commit_callbacks
):
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    first = forget_post(client, {"what": "all", "confirm": "yes"}, django_capture_on_commit_callbacks)
    again = forget_post(client, {"what": "all", "confirm": "yes"}, django_capture_on_commit_callbacks)
    assert first["Location"] != again["Location"]
    assert ForgetRequest.objects.filter(tenant=tenant_a, status="completed").count() == 2


def test_forgetting_everything_needs_the_confirmation(api, seeded):
    client = open_portal(issue(api)["url"])
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "all"})
    assert r.status_code == 400 and "Tick the box" in page_text(r)
    assert not ForgetRequest.objects.exists()


@pytest.mark.parametrize(
    "key",
    ["user:u2:pref_lang", "user:u404:nothing", "user:u1:pref_lang@globex"],
    ids=["other_subject", "missing", "unknown"],
)
def test_forgetting_a_key_that_is_not_the_users_is_404_and_changes_nothing(api, seeded, key):
    before = list(Memory.objects.order_by("pk").values_list("pk", "value", "version"))
    client = open_portal(issue(api)["url"])
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": key})
    assert r.status_code == 404 and "Nothing to forget there" in page_text(r)
    assert not ForgetRequest.objects.exists()
    assert list(Memory.objects.order_by("pk").values_list("pk", "value", "version")) == before
    event = AuditEvent.objects.get(action="forget.create")
    assert (event.actor_kind, event.outcome) == ("end_user", "not_found")


def test_a_key_rewritten_for_another_user_after_the_page_showed_it_is_not_forgotten(api, seeded):
    # The page lists task:t9:status (u1's); before u1 presses "Forget", the app writes the key
    # for u2: the forget is refused as not u1's, and u2's memory stays.
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    assert "task:t9:status" in page_text(client.get("/portal/"))
    token = csrf(client)
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="task:t9:status", value="u2's now", subject="u2")
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": token, "what": "one", "key": "task:t9:status"})
    assert r.status_code == 404 and not ForgetRequest.objects.exists()
    assert Memory.objects.get(tenant=tenant_a, key="task:t9:status").subject == "u2"


def test_a_key_rewritten_for_another_user_before_the_forget_runs_is_not_erased(
    api, seeded, django_capture_on_commit_callbacks
):
    # u1's forget of one key is filed; before the background job runs, the app writes the
    # key for u2. The job erases only u1's memories under that key (its trashed copies too):
    # it used to erase the key whoever it belonged to by then.
    tenant_a, _ = seeded
    client = open_portal(issue(api)["url"])
    with django_capture_on_commit_callbacks(execute=False):  # filed, not run yet
        r = client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": "task:t9:status"})
    assert r.status_code == 302
    services.memory_delete(tenant=tenant_a, actor=SYSTEM, key="task:t9:status")  # u1's copy, in the trash
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="task:t9:status", value=CANARY_U2, subject="u2")
    request = ForgetRequest.objects.get()
    forget.forget_request_execute(request_id=request.pk)
    request.refresh_from_db()
    assert request.status == "completed" and request.receipt["memories"] == 1
    assert list(Memory.objects.filter(tenant=tenant_a, key="task:t9:status").values_list("subject", flat=True)) == [
        "u2"
    ]
    assert services.memory_read(tenant=tenant_a, actor=SYSTEM, key="task:t9:status").memory.value == CANARY_U2


def test_another_tenants_user_cannot_forget_this_tenants_memory(api_b, seeded):
    """Tenant B's u1 posts tenant A's key of (the same-named) u1: not found, nothing filed."""
    tenant_a, _ = seeded
    client = open_portal(issue(api_b)["url"])
    body = {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": "user:u1:shipping_addr"}
    r = client.post("/portal/forget", body)
    assert r.status_code == 404
    assert not ForgetRequest.objects.exists()
    assert Memory.objects.filter(tenant=tenant_a, subject="u1").count() == 3


def test_a_bad_key_or_choice_is_400(api, seeded):
    client = open_portal(issue(api)["url"])
    token = csrf(client)
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": token, "what": "one", "key": "bad key with spaces"})
    assert r.status_code == 400 and "key:" in page_text(r)
    r = client.post("/portal/forget", {"csrfmiddlewaretoken": token, "what": "some"})
    assert r.status_code == 400
    assert not ForgetRequest.objects.exists()


@pytest.mark.postgres
def test_the_users_requests_are_found_through_indexes_not_every_tenants_history(api, seeded, tenant_b):
    """The page lists the requests filed for the subject or by the end user: with no index on
    the second half, the OR read every forget request of every tenant (kept with their
    receipts): 600k requests, 80 ms a page load. Now a BitmapOr of two indexes."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    tenant_a, _ = seeded
    now = timezone.now()
    ForgetRequest.objects.bulk_create(
        ForgetRequest(
            tenant=tenant,
            subject=f"s{n}",
            status="completed",
            requested_by_kind="api_key",
            requested_by="1",
            due_at=now,
        )
        for tenant in (tenant_a, tenant_b)
        for n in range(10_000)
    )
    client = open_portal(issue(api)["url"])
    client.post("/portal/forget", {"csrfmiddlewaretoken": csrf(client), "what": "one", "key": "user:u1:pref_lang"})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE memories_forgetrequest")
    with CaptureQueriesContext(connection) as queries:
        text = page_text(client.get("/portal/"))
    assert "One memory: Preferred language" in text
    (listing,) = [q["sql"] for q in queries if 'FROM "memories_forgetrequest"' in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + listing)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "forget_tenant_end_user" in plan and "forget_tenant_subject" in plan, plan
    assert "Seq Scan on memories_forgetrequest" not in plan, plan


def test_request_pages_of_other_subjects_and_tenants_are_404(api, api_b, seeded, django_capture_on_commit_callbacks):
    tenant_a, tenant_b = seeded
    other_subject = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u2")
    other_tenant = services.forget_request_create(tenant=tenant_b, actor=SYSTEM, subject="u1")
    by_staff_about_keys = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, keys=["user:u1:pref_lang"])
    about_u1 = services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject="u1")
    client = open_portal(issue(api)["url"])
    for request in (other_subject, other_tenant, by_staff_about_keys):
        r = client.get(f"/portal/requests/{request.uid}")
        assert r.status_code == 404 and "No such request" in page_text(r)
    # A request the tenant filed for the whole subject is the user's to follow.
    assert client.get(f"/portal/requests/{about_u1.uid}").status_code == 200
    assert client.get("/portal/requests/999999999").status_code == 404
    # The old numeric URL of the end user's own request is not found either.
    assert client.get(f"/portal/requests/{about_u1.pk}").status_code == 404


# --- sessions, CSRF, methods ---------------------------------------------------------------


def test_portal_pages_without_a_session_are_403(db):
    client = Client()
    for method, path in (("get", "/portal/"), ("post", "/portal/forget"), ("get", "/portal/requests/1")):
        r = getattr(client, method)(path, {"what": "all", "confirm": "yes"} if method == "post" else None)
        assert r.status_code == 403 and "Please open a new link" in page_text(r)
    assert not ForgetRequest.objects.exists()


# What Chromium sends (Fetch Metadata) when another site loads the page: an <img>, an
# <iframe>, a link or script moving the window there, a sibling subdomain's link; and when
# the user's own page does (a link or button here, a redirect, a reload, a typed address).
FROM_ANOTHER_SITE = {
    "img": {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"},
    "iframe": {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "iframe"},
    "navigation": {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    "subdomain": {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    "fetch": {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"},
}
FROM_THE_USER = {
    "own page": {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    "typed": {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    "no metadata": {},
}


@pytest.mark.parametrize("how", list(FROM_ANOTHER_SITE))
def test_a_page_another_site_makes_the_browser_load_reads_counts_and_writes_nothing(
    api, seeded, django_capture_on_commit_callbacks, how
):
    # Each page is an audit row in the tenant's append-only log (and one of the session's
    # pages per minute): another site could add rows, or use up the session, at will.
    client = open_portal(issue(api)["url"])
    with django_capture_on_commit_callbacks(execute=True):
        forget_request = subjects.subject_forget(tenant=seeded[0], actor=SYSTEM, subject="u1", key="user:u1:pref_lang")
    before = AuditEvent.objects.count()
    for path in ("/portal/", f"/portal/requests/{forget_request.uid}"):
        r = client.get(path, headers=FROM_ANOTHER_SITE[how])
        assert r.status_code == 403 and "Please open a new link" in page_text(r), path
        assert CANARY_U1 not in page_text(r) and "Shipping address" not in page_text(r)
    assert AuditEvent.objects.count() == before
    assert client.get("/portal/", headers=FROM_THE_USER["own page"]).status_code == 200


@pytest.mark.parametrize("how", list(FROM_THE_USER))
def test_the_users_own_navigations_show_the_page(api, seeded, how):
    client = open_portal(issue(api)["url"])
    r = client.get("/portal/", headers=FROM_THE_USER[how])
    assert r.status_code == 200 and "Shipping address" in page_text(r)
    assert AuditEvent.objects.filter(action="subject.memories", actor_kind="end_user").count() == 1


def test_the_session_cookie_is_never_sent_on_a_request_another_site_starts(api, seeded):
    # SameSite=Strict: Lax sends it on a link followed from another site (a top-level GET).
    client = open_portal(issue(api)["url"])
    cookie = client.cookies[COOKIE]
    assert (cookie["samesite"], cookie["httponly"], cookie["path"]) == ("Strict", True, "/portal/")


def test_a_tampered_session_cookie_is_refused(api, api_b, seeded):
    client = open_portal(issue(api)["url"])
    other = open_portal(issue(api_b)["url"])
    b_link = PortalLink.objects.get(tenant=seeded[1])
    value = client.cookies[COOKIE].value
    # Name tenant B's link with A's signature, and a signature-less value.
    for forged in (value.replace(value.split(":", 1)[0], str(b_link.pk), 1), str(b_link.pk)):
        client.cookies[COOKIE] = forged
        r = client.get("/portal/")
        assert r.status_code == 403 and CANARY_B not in page_text(r)
    assert other.get("/portal/").status_code == 200


def test_the_session_ends_after_its_lifetime(api, seeded, settings, monkeypatch):
    settings.ZEROMEM_PORTAL_SESSION_SECONDS = 300
    client = open_portal(issue(api)["url"])
    assert client.get("/portal/").status_code == 200
    import time

    later = time.time() + 301
    monkeypatch.setattr(time, "time", lambda: later)  # django.core.signing reads time.time()
    assert client.get("/portal/").status_code == 403


def test_closing_the_page_ends_the_session_on_the_server(api, seeded):
    client = open_portal(issue(api)["url"])
    cookie = client.cookies[COOKIE].value
    r = client.post("/portal/sign-out", {"csrfmiddlewaretoken": csrf(client)})
    assert r.status_code == 200 and "Page closed" in page_text(r)
    assert PortalLink.objects.get().closed_at is not None
    replay = Client()
    replay.cookies[COOKIE] = cookie  # a copy of the cookie taken before
    assert replay.get("/portal/").status_code == 403


def test_portal_forms_are_csrf_protected(api, seeded):
    url = issue(api)["url"]
    strict = Client(enforce_csrf_checks=True)
    assert strict.post(path_of(url)).status_code == 403  # opening without the page's token
    assert PortalLink.objects.get().opened_at is None
    client = open_portal(url, strict)
    r = client.post("/portal/forget", {"what": "all", "confirm": "yes"})
    assert r.status_code == 403
    assert not ForgetRequest.objects.exists()


@pytest.mark.parametrize(
    ("method", "path"),
    [("put", "/portal/"), ("delete", "/portal/forget"), ("get", "/portal/forget"), ("patch", "/portal/sign-out")],
)
def test_other_methods_are_405(api, seeded, method, path):
    # (A browser's PUT/DELETE/PATCH would first meet the CSRF check: 403; hence no CSRF here.)
    client = open_portal(issue(api)["url"], Client())
    assert getattr(client, method)(path).status_code == 405


# --- audit ---------------------------------------------------------------------------------


def test_every_portal_action_is_audited_with_the_end_user_as_actor(api, seeded, django_capture_on_commit_callbacks):
    client = open_portal(issue(api)["url"])
    client.get("/portal/", headers={"X-Request-ID": "portal-req-0001"})
    forget_post(client, {"what": "all", "confirm": "yes"}, django_capture_on_commit_callbacks)
    request = ForgetRequest.objects.get()
    client.get(f"/portal/requests/{request.uid}")
    client.post("/portal/sign-out", {"csrfmiddlewaretoken": csrf(client)})

    by_user = AuditEvent.objects.filter(actor_kind="end_user").order_by("pk")
    actions = [e.action for e in by_user]
    assert actions[0] == "portal.open"
    assert {"subject.memories", "forget.list", "forget.create", "forget.read", "portal.sign_out"} <= set(actions)
    # Events from before the forget request was carried out have the end user's identifiers
    # redacted (a pseudonym, no address); later ones (reading the receipt, signing out) not.
    pseudonym = chain.pseudonym(request.tenant_id, "u1")
    who = {(e.actor_id, e.client_ip) for e in by_user}
    assert who == {(pseudonym, None), ("u1", "127.0.0.1")}, who
    for event in by_user:
        assert (event.actor_label, event.surface) == ("end user", "portal"), event
        assert event.request_id
    assert by_user.filter(action="subject.memories", request_id__endswith=".portal-req-0001").exists()
    created = by_user.get(action="forget.create")
    assert created.detail["forget_request"] == str(request.uid)
    # Never a value in the audit log.
    for event in AuditEvent.objects.all():
        assert CANARY_U1 not in str(event.__dict__) and "Lyon" not in str(event.__dict__)


def test_an_end_user_actor_cannot_name_another_subject(tenant_a):
    actor = Actor(kind="end_user", id="u1", label="end user", scopes=frozenset(Scope.values), surface="portal")
    for call in (
        lambda: subjects.subject_memories(tenant=tenant_a, actor=actor, subject="u2"),
        lambda: subjects.subject_forget(tenant=tenant_a, actor=actor, subject="u2"),
        lambda: subjects.subject_forget_requests(tenant=tenant_a, actor=actor, subject="u2"),
    ):
        with pytest.raises(Forbidden):
            call()
    assert not ForgetRequest.objects.exists()
    assert AuditEvent.objects.filter(outcome="denied", detail__code="not_your_subject").count() == 3


def test_a_long_subject_gets_a_stable_actor_id_that_fits_the_audit_log(api, tenant_a):
    subject = "s" * 200
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="note:n1", value="x", subject=subject)
    client = open_portal(issue(api, subject)["url"])
    assert "Nothing is remembered" not in page_text(client.get("/portal/"))
    event = AuditEvent.objects.filter(actor_kind="end_user", action="subject.memories").get()
    assert event.actor_id == subjects.end_user_actor_id(subject) and len(event.actor_id) <= 64
    assert event.subject == subject


def test_a_long_subjects_actor_id_is_keyed_and_its_portal_events_are_redacted_by_a_forget(
    api, tenant_a, django_capture_on_commit_callbacks
):
    import hashlib

    subject = "s" * 200
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="note:n1", value="x", subject=subject)
    client = open_portal(issue(api, subject)["url"])
    client.get("/portal/")
    actor_id = subjects.end_user_actor_id(subject)
    # Not an unkeyed hash that anyone knowing the subject could recompute.
    assert hashlib.sha256(subject.encode()).hexdigest()[:20] not in actor_id
    by_user = AuditEvent.objects.filter(actor_kind="end_user", actor_id=actor_id)
    assert by_user.filter(action="portal.open", client_ip__isnull=False).exists()
    with django_capture_on_commit_callbacks(execute=True):
        services.forget_request_create(tenant=tenant_a, actor=SYSTEM, subject=subject)
    assert not AuditEvent.objects.filter(actor_kind="end_user", actor_id=actor_id).exists()
    assert not AuditEvent.objects.filter(actor_kind="end_user", client_ip__isnull=False).exists()


def test_a_subject_spelled_like_another_subjects_digest_is_another_end_user(api, tenant_a):
    # A subject of 64 characters or fewer was its own actor id, so the subject spelled as a
    # long subject's digest ("hmac:…", 64 characters) was the same end user to the services:
    # its page listed the other user's forget requests, and a forget of either redacted both.
    long_subject = "s" * 200
    lookalike = subjects.end_user_actor_id(long_subject)
    assert lookalike.startswith("hmac:") and len(lookalike) == 64
    assert subjects.end_user_actor_id(lookalike) != lookalike
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="note:n1", value="x", subject=long_subject)
    services.memory_write(tenant=tenant_a, actor=SYSTEM, key="note:n2", value="y", subject=lookalike)
    owner = open_portal(issue(api, long_subject)["url"])
    owner.post("/portal/forget", {"csrfmiddlewaretoken": csrf(owner), "what": "one", "key": "note:n1"})
    (request,) = ForgetRequest.objects.filter(tenant=tenant_a)
    other = open_portal(issue(api, lookalike)["url"])
    assert "Your requests to forget" not in page_text(other.get("/portal/"))
    assert other.get(f"/portal/requests/{request.uid}").status_code == 404


# --- purging spent links -------------------------------------------------------------------


def test_spent_links_are_purged_after_expiry_and_session(api, seeded, settings, monkeypatch):
    from memories.portal.services import portal_links_purge
    from zeromem.schedules import SCHEDULES

    assert SCHEDULES["zeromem:portal-links-purge"][0] == "memories.portal.tasks.portal_links_purge_task"
    settings.ZEROMEM_PORTAL_LINK_SECONDS = 60
    settings.ZEROMEM_PORTAL_SESSION_SECONDS = 600
    opened = issue(api)["url"]
    client = open_portal(opened)
    unused = issue(api)["url"]
    start = timezone.now()

    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(seconds=60 + 590))
    assert portal_links_purge() == 0  # a session opened at the last moment may still be open
    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(seconds=61 + 601))
    assert portal_links_purge() == 2
    assert not PortalLink.objects.exists()
    assert AuditEvent.objects.get(action="portal.links_purge").count == 2
    for url in (opened, unused):  # nothing is left that knows the token
        r = Client().get(path_of(url))
        assert r.status_code == 400 and "This link does not work" in page_text(r)
    assert client.get("/portal/").status_code == 403
