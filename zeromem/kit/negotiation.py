"""Content negotiation for every API view (``DEFAULT_CONTENT_NEGOTIATION_CLASS``). A module
of its own: DRF imports it while it builds ``APIView``, which zeromem/kit/api.py imports."""

from rest_framework.negotiation import DefaultContentNegotiation


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's content negotiation, with the answer to the requests nearly every client sends
    — no ``Accept``, ``*/*`` or exactly the one renderer's media type, no format override —
    given without parsing the header (what DRF would answer: the renderer and its media
    type). Anything else is DRF's, as before."""

    def select_renderer(self, request, renderers, format_suffix=None):
        if format_suffix is None and self.settings.URL_FORMAT_OVERRIDE is None and len(renderers) == 1:
            renderer = renderers[0]
            accept = request.META.get("HTTP_ACCEPT")
            if (accept is None or accept == "*/*" or accept == renderer.media_type) and ";" not in renderer.media_type:
                return renderer, renderer.media_type
        return super().select_renderer(request, renderers, format_suffix)
