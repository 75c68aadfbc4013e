from django.contrib import admin
from django.core.exceptions import DisallowedHost, RequestDataTooBig, TooManyFieldsSent
from django.db import DatabaseError, connection
from django.http import JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularRedocView, SpectacularSwaggerView

from memories.api.metrics import MetricsView
from zeromem.kit.api import too_many_fields
from zeromem.kit.schema import SchemaView
from zeromem.middleware import API_PATHS, error_response


@csrf_exempt  # no cookie auth and no state: a POST gets 405 below, not a CSRF page
def healthz(request):
    """200 when the database answers a query, 503 otherwise (for load balancers)."""
    if request.method not in ("GET", "HEAD"):
        response = error_response(405, "method_not_allowed", f'Method "{request.method}" not allowed.')
        response["Allow"] = "GET, HEAD"
        return response
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError:
        return error_response(503, "database_unavailable", "the database does not answer")
    return JsonResponse({"status": "ok", "database": connection.vendor})


def api_not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return error_response(404, "not_found", "no such endpoint")
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def api_bad_request(request, exception=None):
    """Django's own refusals before any view (a Host outside ALLOWED_HOSTS, more query
    parameters than DATA_UPLOAD_MAX_NUMBER_FIELDS, a body Django will not read): on API paths
    in the error envelope, like every other answer there; elsewhere Django's page."""
    if request.path.startswith(API_PATHS):
        if isinstance(exception, DisallowedHost):
            return error_response(400, "bad_host", "Invalid Host header", field="Host")
        if isinstance(exception, RequestDataTooBig):
            return error_response(413, "too_large", "request body is too large", field="body")
        if isinstance(exception, TooManyFieldsSent):
            error = too_many_fields()
            return error_response(400, error.code, error.message, field=error.field)
        return error_response(400, "bad_request", "the request is malformed")
    from django.views.defaults import bad_request

    return bad_request(request, exception)


def server_error(request):
    return error_response(500, "server_error", "internal error; the request id is in X-Request-ID")


READ_ONLY = ["get", "head"]

handler400 = api_bad_request
handler404 = api_not_found
handler500 = server_error

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("api/v1/", include("memories.api.urls")),
    path("api/v1/", include("audit.urls")),
    # Read-only pages: other methods are 405 (OPTIONS on the Swagger page was a 500: DRF's
    # metadata response rendered through its HTML template).
    path("api/v1/schema", SchemaView.as_view(http_method_names=READ_ONLY), name="schema"),
    path(
        "api/v1/docs",
        SpectacularSwaggerView.as_view(url_name="schema", http_method_names=READ_ONLY),
        name="api-docs",
    ),
    path(
        "api/v1/redoc",
        SpectacularRedocView.as_view(url_name="schema", http_method_names=READ_ONLY),
        name="api-redoc",
    ),
    path("admin/", admin.site.urls),
    path("portal/", include("memories.portal.urls")),
]
