"""``GET /metrics``: the fleet's Prometheus metrics (zeromem/kit/metrics.py), for an API key
with the operator scope ``metrics:read`` only — 401 without a key, 403 with a key that lacks it
(or is limited to some key prefixes).
Scrapes are not audited (a scraper every 15 s would fill a tenant's log); they count against
the key's rate limit like any request."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema

from zeromem.kernel.actors import require_scope
from zeromem.kernel.errors import Forbidden
from zeromem.kernel.scopes import Scope
from zeromem.kit.api import TenantAPIView
from zeromem.kit.metrics import exposition


class MetricsView(TenantAPIView):
    surface = "rest"
    http_method_names = ["get", "head"]

    @extend_schema(exclude=True)  # the operator's endpoint, not the tenant API
    def get(self, request):
        require_scope(self.actor, Scope.METRICS_READ)
        if self.actor.allowed_prefixes:  # a key narrowed to some keys reads nothing deployment-wide
            raise Forbidden(code="key_not_allowed", message="a key limited to some prefixes may not read metrics")
        body, content_type = exposition()
        return HttpResponse(body, content_type=content_type)
