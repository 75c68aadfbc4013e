from rest_framework.renderers import JSONRenderer

from zeromem.kernel.tokens import compact_json


class CompactJSONRenderer(JSONRenderer):
    """What goes back to the model: no spaces, UTF-8 text rather than \\u escapes."""

    ensure_ascii = False
    compact = True

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        return compact_json(data)
