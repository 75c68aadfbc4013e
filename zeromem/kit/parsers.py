"""The request parser every API view uses (settings REST_FRAMEWORK DEFAULT_PARSER_CLASSES).

Its own module: DRF imports it while loading its views, so it may import nothing that
imports those views (zeromem.kit.api does).
"""

import codecs
import math

from rest_framework import exceptions, parsers
from rest_framework.utils import json

from zeromem.kernel import validation


# A number such as 1e400 reads as float("inf") (DRF refuses only the literals Infinity and
# NaN): an answer that echoes it (memory_read's default) could not be rendered (a 500, after
# a batch's earlier calls had committed). Every float is checked as it is read: ~0.06 µs each
# (a 1-MB body of floats parses in 1.3× json's own time). A pattern run over the text to
# spare that cost cost more: 40-230 ms of CPU per MB of digits, whatever the body held.
def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text[:40]} is out of range")
    return number


class JSONParser(parsers.JSONParser):
    """DRF's parser (its decoding and strict constants), but a body nested past the
    interpreter's recursion limit (thousands of levels) or with a number past a double's range
    (``1e400``) is a 400 ``malformed_json`` instead of a 500, and a string holding a lone
    surrogate (``"\\ud800"``, which nothing can store) is a 400 ``invalid_characters`` naming
    where it is (:func:`zeromem.kernel.validation.lone_surrogate_field`), and an object that
    names a member twice is a 400 ``duplicate_key`` naming its path (``arguments.key``; Python
    kept the last value, a proxy or an audit of the raw body may read the first). Values nested past
    ``validation.VALUE_MAX_DEPTH`` are refused by the services with their field named."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = parsers.get_encoding(parser_context or {})
        try:
            text = codecs.getreader(encoding)(stream).read()
            data = validation.loads_unique(
                text,
                parse_constant=json.strict_constant if self.strict else None,
                parse_float=_finite,
            )
        except validation.DuplicateKey as exc:
            error = exceptions.ParseError(f"JSON parse error - the object {exc}: each name may appear once")
            field = validation.duplicate_key_field(text) or "body"
            error.zeromem_code, error.zeromem_field = "duplicate_key", field
            raise error from None
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
