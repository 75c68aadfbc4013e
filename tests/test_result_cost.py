"""Cost you can see: every tool response says its size and estimated tokens
(``ZeroMem-Result-Bytes``/``-Tokens``), the tenant's daily counters add them up, and the
admin dashboard shows the sum next to its estimate of tokens saved."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from memories.models import TokenUsageDay
from memories.selectors.dashboard import tenant_dashboard
from memories.services import usage
from tests.factories import make_keyed_client
from zeromem.kernel.tokens import cost_of, estimate_tokens


def test_estimator_ascii_by_four_and_one_token_per_non_ascii_character():
    assert estimate_tokens("") == 0
    assert estimate_tokens("abcd" * 10) == 10
    assert estimate_tokens("abcde") == 2
    assert estimate_tokens("日本語") == 3
    assert estimate_tokens('{"v":"日本語"}') == 2 + 3  # 8 ASCII characters → 2, three CJK → 3
    assert cost_of("é".encode()) == (2, 1)


def _headers(r) -> tuple[int, int]:
    return int(r["ZeroMem-Result-Bytes"]), int(r["ZeroMem-Result-Tokens"])


@pytest.mark.django_db
def test_tool_call_and_batch_carry_their_cost_and_the_day_adds_them_up(tenant_a, tenant_b):
    client, _ = make_keyed_client(tenant_a)
    other, _ = make_keyed_client(tenant_b)
    sent = []

    r = client.post("/api/v1/tools/call", {"name": "memory_write", "arguments": {"key": "n:k", "value": "中文" * 50}})
    sent.append(r)
    r = client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "n:k"}})
    sent.append(r)
    size, tokens = _headers(r)
    assert size == len(r.content) and tokens == estimate_tokens(r.content.decode())
    assert tokens > size / 4  # CJK: a token per character, not per four bytes
    assert json.loads(r.content)["value"] == "中文" * 50

    r = client.post("/api/v1/tools/batch", {"calls": [{"name": "memory_read", "arguments": {"key": "n:k"}}] * 3})
    sent.append(r)
    assert _headers(r) == (len(r.content), estimate_tokens(r.content.decode()))

    r = client.post("/api/v1/tools/call", {"name": "memory_read", "arguments": {"key": "Bad Key"}})
    sent.append(r)
    assert r.status_code == 400 and _headers(r)[0] == len(r.content)  # the model reads errors too

    other.post("/api/v1/tools/call", {"name": "memory_list", "arguments": {}})
    row = TokenUsageDay.objects.get(tenant=tenant_a, day=timezone.now().date())
    assert (row.results, row.bytes, row.tokens) == (
        len(sent),
        sum(_headers(r)[0] for r in sent),
        sum(_headers(r)[1] for r in sent),
    )
    assert TokenUsageDay.objects.get(tenant=tenant_b).results == 1

    figures = tenant_dashboard(tenant=tenant_a)
    assert figures.tokens_returned[-1] == row.tokens and figures.tokens["returned"] == row.tokens


@pytest.mark.django_db
def test_totals_wait_in_the_process_until_due_then_one_statement_writes_them(tenant_a, settings):
    settings.ZEROMEM_USAGE_FLUSH_SECONDS = 3600
    usage.flush()
    client, _ = make_keyed_client(tenant_a)
    for _ in range(3):
        client.post("/api/v1/tools/call", {"name": "memory_list", "arguments": {}})
    assert not TokenUsageDay.objects.filter(tenant=tenant_a).exists()
    assert usage.flush() == 1
    assert TokenUsageDay.objects.get(tenant=tenant_a).results == 3
    yesterday = timezone.now() - timedelta(days=1)
    usage.result_returned(tenant_id=tenant_a.pk, size=40, tokens=10, now=yesterday)
    usage.flush()
    figures = tenant_dashboard(tenant=tenant_a)
    assert figures.tokens_returned[-2] == 10 and figures.days[-2] == yesterday.date()
