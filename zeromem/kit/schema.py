"""The OpenAPI schema view: drf-spectacular's, built once per process."""

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SCHEMA_KWARGS, SpectacularAPIView


class SchemaView(SpectacularAPIView):
    """``GET /api/v1/schema``, readable without a key. drf-spectacular builds the schema on
    every request (~40 ms of CPU) and renders it (YAML ~20 ms): ~65 ms per anonymous request
    against ~1 ms for ``/healthz``, so anyone looping on it took the web tier's threads. The
    schema holds no tenant data and changes only with the code: built and rendered once per
    process and format. Its ``lang`` and ``version`` parameters are not read (no translation
    of it exists; the API has no versioning), so no parameter can make a new copy."""

    _rendered: dict[str, tuple[bytes, str, str]] = {}

    @extend_schema(**SCHEMA_KWARGS)  # as drf-spectacular's view: not in the schema itself
    def get(self, request, *args, **kwargs):
        renderer = request.accepted_renderer
        cached = self._rendered.get(renderer.media_type)
        if cached is None:
            schema = self.generator_class(urlconf=self.urlconf, patterns=self.patterns).get_schema(
                request=None, public=self.serve_public
            )
            body = renderer.render(schema, renderer.media_type, {})
            charset = renderer.charset
            content_type = f"{renderer.media_type}; charset={charset}" if charset else renderer.media_type
            cached = self._rendered.setdefault(
                renderer.media_type, (body, content_type, self._get_filename(request, None))
            )
        body, content_type, filename = cached
        response = HttpResponse(body, content_type=content_type)
        response["Content-Disposition"] = f'inline; filename="{filename}"'
        return response
