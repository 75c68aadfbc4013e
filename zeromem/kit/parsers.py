"""The request parser every API view uses (settings REST_FRAMEWORK DEFAULT_PARSER_CLASSES).

Its own module: DRF imports it while loading its views, so it may import nothing that
imports those views (zeromem.kit.api does).
"""

import codecs

from rest_framework import exceptions, parsers
from rest_framework.utils import json

from zeromem.kernel import validation


class JSONParser(parsers.JSONParser):
    """DRF's parser (its decoding and strict constants), but a body nested past the
    interpreter's recursion limit (thousands of levels) is a 400 ``malformed_json`` instead
    of a RecursionError (500), and a string holding a lone surrogate (``"\\ud800"``, which
    nothing can store) is a 400 ``invalid_characters`` naming where it is
    (:func:`zeromem.kernel.validation.lone_surrogate_field`). Values nested past
    ``validation.VALUE_MAX_DEPTH`` are refused by the services with their field named."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = parsers.get_encoding(parser_context or {})
        try:
            text = codecs.getreader(encoding)(stream).read()
            data = json.loads(text, parse_constant=json.strict_constant if self.strict else None)
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        except RecursionError:
            raise exceptions.ParseError("JSON nested too deeply") from None
        field = validation.lone_surrogate_field(text, data)
        if field is not None:
            error = exceptions.ParseError(
                "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored"
            )
            error.zeromem_code, error.zeromem_field = "invalid_characters", field
            raise error
        return data
