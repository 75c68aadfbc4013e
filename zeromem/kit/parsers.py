"""The request parser every API view uses (settings REST_FRAMEWORK DEFAULT_PARSER_CLASSES).

Its own module: DRF imports it while loading its views, so it may import nothing that
imports those views (zeromem.kit.api does).
"""

from rest_framework import exceptions, parsers


class JSONParser(parsers.JSONParser):
    """DRF's parser, but a body nested past the interpreter's recursion limit (thousands of
    levels) is a 400 ``malformed_json`` instead of a RecursionError (500). Values nested past
    ``validation.VALUE_MAX_DEPTH`` are refused by the services with their field named."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON nested too deeply") from None
