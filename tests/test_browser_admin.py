"""Browser tests of the admin console (Playwright, headless Chromium, live server).

A support user logs in, finds a subject's memory, edits it, sees the new version in the
history and forgets it; then a compliance reviewer follows the audit trail of those steps and
never sees a value. Screenshots: test-artifacts/test_browser_admin/<test>/.
"""

from __future__ import annotations

import re

from django.contrib.auth import get_user_model

from audit.models import AuditEvent
from memories import services
from memories.models import ForgetRequest, Memory
from tests.factories import SYSTEM, make_tenant, write

pytest_plugins = ["tests.admin_fixtures"]

KEY = "user:u10086:pref_lang"
OLD_VALUE = "prefers English (CANARY-old-1f3a)"
NEW_VALUE = "prefers Chinese (CANARY-new-8b2d)"
PASSWORD = "a long staff password"


def _member(tenant, role, username):
    get_user_model().objects.create_user(username=username, password=PASSWORD)
    services.membership_set(tenant=tenant, actor=SYSTEM, username=username, role=role)


def _log_in(page, base, username):
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    assert "Log in" not in page.title()


def test_support_edits_and_forgets_a_memory_and_compliance_sees_the_trail_without_values(
    browser_page, live_server, screenshot, fast_password_hashing
):
    page, base = browser_page, live_server.url
    tenant = make_tenant("acme")
    memory = write(tenant, KEY, OLD_VALUE)
    write(tenant, "user:u10086:diet", "vegetarian")
    write(tenant, "user:u2:pref_lang", "prefers French")
    _member(tenant, "support", "sam-support")
    _member(tenant, "compliance", "carla-compliance")

    # --- support: log in, find the subject's memory ---------------------------------------
    _log_in(page, base, "sam-support")
    screenshot("support-index")
    page.goto(f"{base}/admin/memories/memory/")
    page.fill("form.zeromem-input-filter input[name=subject]", "u10086")
    page.press("form.zeromem-input-filter input[name=subject]", "Enter")
    page.wait_for_url(re.compile(r"subject=u10086"))
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 2
    assert "user:u2:pref_lang" not in page.content()
    screenshot("support-finds-subject")

    # --- open it (an audited read) and edit the value -------------------------------------
    page.click(f"#result_list a:text-is('{KEY}')")
    page.wait_for_selector("textarea[name=value]")
    assert OLD_VALUE in page.input_value("textarea[name=value]")
    screenshot("support-opens-memory")
    page.fill("textarea[name=value]", '"prefers Chinese')  # broken JSON first: a clear error
    page.click("input[name=_continue]")
    error = page.locator(".errorlist").first.inner_text()
    assert "Not valid JSON" in error
    screenshot("support-sees-json-error")
    page.fill("textarea[name=value]", f'"{NEW_VALUE}"')
    page.click("input[name=_continue]")
    page.wait_for_selector(".messagelist .success")
    memory.refresh_from_db()
    assert (memory.value, memory.version) == (NEW_VALUE, 2)
    screenshot("support-saved")

    # --- the history shows the new version -------------------------------------------------
    page.click("a.historylink")
    page.wait_for_selector("#version-history")
    first = page.locator("#version-history tbody tr").first
    assert first.get_attribute("data-version") == "2"
    assert NEW_VALUE in first.inner_text() and "sam-support" in first.inner_text() and "update" in first.inner_text()
    assert OLD_VALUE in page.locator('#version-history tr[data-version="1"]').inner_text()
    screenshot("support-history")

    # --- forget it --------------------------------------------------------------------------
    page.goto(f"{base}/admin/memories/memory/?subject=u10086")
    page.check(f"input[name=_selected_action][value='{memory.pk}']")
    page.select_option("select[name=action]", "forget_selected")
    page.fill("input[name=reason]", "the customer asked by email")
    screenshot("support-chooses-forget")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist li")
    assert "Forget request" in page.locator(".messagelist").inner_text()
    page.click(".messagelist a")
    page.wait_for_selector(".field-receipt_display")
    assert "Completed" in page.locator(".field-status").inner_text()
    assert '"memories": 1' in page.locator(".field-receipt_display").inner_text()
    screenshot("support-receipt")
    assert not Memory.objects.filter(tenant=tenant, key=KEY).exists()
    request = ForgetRequest.objects.get(tenant=tenant)
    assert request.status == "completed" and request.keys == [KEY]

    # --- compliance: the audit trail of those steps, and no value anywhere -----------------
    page.context.clear_cookies()
    _log_in(page, base, "carla-compliance")
    page.goto(f"{base}/admin/audit/auditevent/?actor=sam-support")
    trail = page.locator("#result_list tbody").inner_text()
    for action in ("memory.view", "memory.update", "memory.history", "forget.create"):
        assert action in trail, action
    # the forget request also redacted the key in those events (a pseudonym stands in for it)
    assert KEY not in trail
    screenshot("compliance-audit-trail")
    page.goto(f"{base}/admin/audit/auditevent/?actor=sam-support&action=forget.create")
    assert page.locator("#result_list tbody tr").count() == 1
    page.click("#result_list tbody tr th a")
    page.wait_for_selector(".field-detail_display")
    assert f'"forget_request": "{request.uid}"' in page.locator(".field-detail_display").inner_text()
    screenshot("compliance-forget-event")
    page.goto(f"{base}/admin/memories/forgetrequest/{request.pk}/change/")
    assert "Completed" in page.locator(".field-status").inner_text()
    screenshot("compliance-receipt")
    visited = [page.content()]
    for path in ("/admin/", "/admin/memories/memory/", f"/admin/memories/tenant/{tenant.pk}/dashboard/"):
        page.goto(f"{base}{path}")
        visited.append(page.content())
    screenshot("compliance-dashboard")
    for html in visited:
        assert "CANARY-" not in html and "vegetarian" not in html
    # what compliance saw was audited as what it is: no memory.view by compliance
    assert not AuditEvent.objects.filter(actor_label="carla-compliance", action__startswith="memory.").exists()


def test_support_pages_through_a_long_history_and_opens_one_whole_version(
    browser_page, live_server, screenshot, fast_password_hashing
):
    page, base = browser_page, live_server.url
    tenant = make_tenant("acme-history")
    tenant.value_max_bytes = 64 * 1024
    tenant.save(update_fields=["value_max_bytes"])
    memory = write(tenant, KEY, "v1 " + "x" * 20_000 + " END-1")
    for n in range(2, 26):
        services.memory_update(tenant=tenant, actor=SYSTEM, key=KEY, value=f"v{n} " + "x" * 20_000 + f" END-{n}")
    _member(tenant, "support", "sam-support")
    _log_in(page, base, "sam-support")

    page.goto(f"{base}/admin/memories/memory/{memory.pk}/history/")
    rows = page.locator("#version-history tbody tr.version-row")
    assert rows.count() == 20 and rows.first.get_attribute("data-version") == "25"
    first = rows.first.inner_text()
    assert "19.5 KB" in first and "v25" in first and "END-25" not in first  # a preview and its size
    screenshot("history-first-page")
    page.click("#older-versions")
    page.wait_for_url(re.compile(r"before=6"))
    assert [r.get_attribute("data-version") for r in rows.all()] == ["5", "4", "3", "2", "1"]
    assert page.locator("#older-versions").count() == 0
    screenshot("history-older-page")
    page.locator('tr[data-version="3"] a.open-whole').click()
    page.wait_for_selector("#version-value")
    assert page.locator("#version-value").inner_text().endswith('END-3"')
    screenshot("history-one-version")
    page.click("text=History")
    page.wait_for_selector("#version-history")
    opened = AuditEvent.objects.filter(tenant=tenant, action="memory.history", detail__opened_version=3)
    assert opened.count() == 1
