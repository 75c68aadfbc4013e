"""The end-user portal in a real browser (headless Chromium, phone-sized): an end user opens
the link the app got for them, sees what is remembered, forgets everything and reads the
receipt. The forget job really runs (django-q2 in sync mode, after the request's commit).
Screenshots: test-artifacts/test_browser_portal/<test>/."""

import re

from memories import services
from memories.models import ForgetRequest, Memory
from memories.portal import views
from tests.factories import SYSTEM, make_key, make_tenant
from tests.helpers import ForeignSite

PHONE = {"width": 390, "height": 844}
CANARY = "CANARY-browser-u1-4c1d"
OTHER_SUBJECT = "CANARY-browser-u2-88e0"
OTHER_TENANT = "CANARY-browser-globex-u1-7a51"


def fits_the_screen(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_end_user_opens_portal_link_forgets_everything_and_sees_the_receipt(browser_page, live_server, screenshot):
    page = browser_page
    tenant = make_tenant("acme")
    other = make_tenant("globex")
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:pref_lang", value=f"Chinese {CANARY}")
    services.memory_write(
        tenant=tenant, actor=SYSTEM, key="user:u1:shipping_addr", value={"city": "Lyon", "floor": 3}, ttl_seconds=86400
    )
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u2:pref_lang", value=OTHER_SUBJECT)
    services.memory_write(tenant=other, actor=SYSTEM, key="user:u1:pref_lang", value=OTHER_TENANT)
    _key, raw = make_key(tenant, scopes=["forget:create"])

    # The tenant's application asks for a link (over HTTP, as it would).
    answer = page.request.post(
        f"{live_server.url}/api/v1/subjects/u1/portal-link", headers={"Authorization": f"Bearer {raw}"}
    )
    assert answer.status == 201, answer.text()
    link = answer.json()["url"]
    assert re.fullmatch(rf"{re.escape(live_server.url)}/portal/open/[A-Za-z0-9_-]{{43}}", link), link  # opaque

    page.set_viewport_size(PHONE)
    page.goto(link)
    assert page.get_by_role("heading", name="See what Acme remembers about you").is_visible()
    screenshot("link-landing")
    page.get_by_role("button", name="Continue to my page").click()

    page.wait_for_url(f"{live_server.url}/portal/")
    body = page.locator("main").inner_text()
    assert "Preferred language" in body and CANARY in body
    assert "Shipping address" in body and "Lyon" in body and "Forgotten automatically on" in body
    assert OTHER_SUBJECT not in body and OTHER_TENANT not in body
    assert page.locator(".card.memory").count() == 2
    assert fits_the_screen(page), "the page scrolls sideways on a phone"
    screenshot("what-is-remembered")

    page.get_by_label("I understand that this cannot be undone").check()
    page.get_by_role("button", name="Forget everything about me").click()

    page.wait_for_url(re.compile(r"/portal/requests/[0-9a-f-]{36}$"))
    page.get_by_role("heading", name="Receipt").wait_for()  # the page refreshes itself until done
    receipt = page.locator("table.receipt").inner_text()
    assert re.search(r"Memories erased\s+2", receipt), receipt
    assert re.search(r"Saved versions erased\s+2", receipt), receipt
    assert "Completed" in receipt and CANARY not in page.content()
    assert fits_the_screen(page)
    screenshot("receipt")

    request = ForgetRequest.objects.get()
    assert (request.status, request.subject, request.requested_by_kind) == ("completed", "u1", "end_user")
    assert not Memory.objects.filter(tenant=tenant, subject="u1").exists()
    assert Memory.objects.filter(tenant=tenant, subject="u2").count() == 1
    assert Memory.objects.filter(tenant=other, subject="u1").count() == 1

    page.get_by_role("link", name="Back to what is remembered about you").click()
    assert "Nothing is remembered about you right now." in page.locator("main").inner_text()
    screenshot("nothing-left")

    # The link was used: opening it again is refused (this browser is pointed to its page).
    response = page.goto(link)
    assert response.status == 410
    assert page.get_by_role("heading", name="This link has already been used").is_visible()
    screenshot("link-replayed")

    # The tenant's application withdraws u1's links: the page this browser has open ends.
    answer = page.request.delete(
        f"{live_server.url}/api/v1/subjects/u1/portal-link", headers={"Authorization": f"Bearer {raw}"}
    )
    assert answer.status == 200 and answer.json() == {"revoked": 1}, answer.text()
    response = page.goto(f"{live_server.url}/portal/")
    assert response.status == 403
    assert page.get_by_role("heading", name="Please open a new link").is_visible()
    screenshot("withdrawn")


def test_another_site_cannot_make_the_users_browser_load_the_portal(browser_page, live_server, monkeypatch):
    # An open portal session; then a page on another site shows the portal as an image and
    # in a frame, and its link takes the window there. Chromium sends no session cookie on
    # any of them (SameSite=Strict; Lax sent it on the link) and says where they come from
    # (Sec-Fetch-Site: cross-site): nothing is read, and the tenant's log gains no row.
    from audit.models import AuditEvent

    page = browser_page
    tenant = make_tenant("acme")
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:pref_lang", value=f"Chinese {CANARY}")
    _key, raw = make_key(tenant, scopes=["forget:create"])
    link = page.request.post(
        f"{live_server.url}/api/v1/subjects/u1/portal-link", headers={"Authorization": f"Bearer {raw}"}
    ).json()["url"]
    page.goto(link)
    page.get_by_role("button", name="Continue to my page").click()
    page.wait_for_url(f"{live_server.url}/portal/")
    assert CANARY in page.locator("main").inner_text()
    reads = AuditEvent.objects.filter(tenant=tenant, action="subject.memories")
    assert reads.count() == 1

    portal = f"{live_server.url}/portal/"
    # Another site, served from 127.0.0.1 (not localhost's site; served from a public name,
    # or faked by the test, Chromium's local network access rules would keep it from loading
    # a loopback address at all), in a tab of its own: the frame it asks for is refused by
    # the portal's frame-ancestors, which the fixture's page would report as a broken page.
    site = ForeignSite(f'<img src="{portal}"><iframe src="{portal}"></iframe><a id="go" href="{portal}">prize</a>')
    elsewhere = site.url + "/"
    assert "127.0.0.1" not in portal
    tab = page.context.new_page()
    # What the server got (the live server runs in this process): Fetch Metadata and cookie.
    seen = []
    judge = views._sent_by_another_site

    def spy(request):
        metadata = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("sec-fetch-")}
        seen.append((metadata, views.COOKIE in request.COOKIES))
        return judge(request)

    monkeypatch.setattr(views, "_sent_by_another_site", spy)
    tab.goto(elsewhere, wait_until="load")
    with tab.expect_navigation(url=portal):
        tab.click("#go")
    assert tab.get_by_role("heading", name="Please open a new link").is_visible()
    assert CANARY not in tab.content()
    tab.close()
    site.close()
    assert reads.count() == 1
    assert sorted((m["sec-fetch-dest"], m["sec-fetch-mode"], m["sec-fetch-site"], c) for m, c in seen) == [
        ("document", "navigate", "cross-site", False),
        ("iframe", "navigate", "cross-site", False),
        ("image", "no-cors", "cross-site", False),
    ], seen
    # The user's own page still opens: a typed address (Sec-Fetch-Site: none) carries the cookie.
    page.goto(portal)
    assert CANARY in page.locator("main").inner_text() and reads.count() == 2


def test_a_link_followed_from_a_webmail_then_forget_one_and_sign_out_work(browser_page, live_server, monkeypatch):
    # The whole flow as an end user meets it: the link clicked in a webmail (another site:
    # Sec-Fetch-Site cross-site, no session cookie), the landing page's Continue (a POST of
    # ours), "Forget this" and "Close this page" (POST forms: navigate, same-origin), all
    # let through by the Fetch Metadata check; after the sign-out the session is gone.
    page = browser_page
    tenant = make_tenant("acme")
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:pref_lang", value=f"Chinese {CANARY}")
    services.memory_write(tenant=tenant, actor=SYSTEM, key="user:u1:tz", value="Europe/Paris")
    _key, raw = make_key(tenant, scopes=["forget:create"])
    link = page.request.post(
        f"{live_server.url}/api/v1/subjects/u1/portal-link", headers={"Authorization": f"Bearer {raw}"}
    ).json()["url"]
    seen = []
    judge = views._sent_by_another_site

    def spy(request):
        seen.append((request.method, request.path, request.headers.get("Sec-Fetch-Site")))
        return judge(request)

    monkeypatch.setattr(views, "_sent_by_another_site", spy)
    webmail = ForeignSite(f'<p>Your link: <a id="open" href="{link}">see what Acme remembers</a></p>')
    page.goto(webmail.url + "/", wait_until="load")
    with page.expect_navigation(url=link):
        page.click("#open")
    page.get_by_role("button", name="Continue to my page").click()
    page.wait_for_url(f"{live_server.url}/portal/")
    assert CANARY in page.locator("main").inner_text()

    page.locator(".card.memory").filter(has_text=CANARY).get_by_role("button", name="Forget this").click()
    page.wait_for_url(re.compile(r"/portal/requests/[0-9a-f-]{36}$"))
    page.get_by_role("heading", name="Receipt").wait_for()
    request = ForgetRequest.objects.get()
    assert (request.status, request.keys, request.receipt["memories"]) == ("completed", ["user:u1:pref_lang"], 1)
    assert list(Memory.objects.filter(tenant=tenant).values_list("key", flat=True)) == ["user:u1:tz"]

    page.get_by_role("link", name="Back to what is remembered about you").click()
    assert "Europe/Paris" in page.locator("main").inner_text()
    page.get_by_role("button", name="Close this page").click()
    page.wait_for_load_state()
    webmail.close()
    response = page.goto(f"{live_server.url}/portal/")
    assert response.status == 403 and page.get_by_role("heading", name="Please open a new link").is_visible()
    assert [(m, p) for m, p, _s in seen] == [
        ("GET", "/portal/"),
        ("POST", "/portal/forget"),
        ("GET", f"/portal/requests/{request.uid}"),
        *[("GET", f"/portal/requests/{request.uid}")] * (len(seen) - 6),
        ("GET", "/portal/"),
        ("GET", "/portal/"),
    ], seen
    assert {s for _m, _p, s in seen[:-1]} == {"same-origin"} and seen[-1][2] == "none"
