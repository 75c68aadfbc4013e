import json

from rest_framework.renderers import JSONRenderer


class CompactJSONRenderer(JSONRenderer):
    """What goes back to the model: no spaces, UTF-8 text rather than \\u escapes."""

    ensure_ascii = False
    compact = True

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        # allow_nan=False: NaN or Infinity would make the answer invalid JSON; the inputs
        # refuse them, and anything that slips through is an error, not a broken body.
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str, allow_nan=False).encode()
