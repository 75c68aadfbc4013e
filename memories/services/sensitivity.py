"""Which memories are sensitive (README "Encryption at rest"): marked ``sensitive: true`` on
write, or matched by the tenant's rules — key patterns (``sensitive_keys``, ``*`` any
characters, e.g. ``user:*:phone``) and JSON field names inside values (``sensitive_fields``,
any depth, case-insensitive, e.g. ``email``, ``phone``, ``id_number``). Once sensitive, a
memory stays so (a later write cannot turn a rule-matched or marked memory back to plaintext
except by ``sensitive: false`` where no rule matches)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from zeromem.kernel import crypto
from zeromem.kernel.errors import InvalidInput

RULES_MAX = 100
RULE_MAX_LEN = 255
_DEPTH_MAX = 64


def matches_rules(tenant, *, key: str, value: Any) -> bool:
    patterns = tenant.sensitive_keys or []
    if any(fnmatchcase(key, p) for p in patterns):
        return True
    names = {f.lower() for f in (tenant.sensitive_fields or [])}
    return bool(names) and _has_field(value, names, 0)


def _has_field(value: Any, names: set[str], depth: int) -> bool:
    if depth > _DEPTH_MAX:
        return False
    if isinstance(value, dict):
        return any(
            (isinstance(k, str) and k.lower() in names) or _has_field(v, names, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list):
        return any(_has_field(v, names, depth + 1) for v in value)
    return False


def flag(raw: Any) -> bool | None:
    """The ``sensitive`` argument: true, false or absent."""
    if raw is None or isinstance(raw, bool):
        return raw
    raise InvalidInput("must be true or false", field="sensitive")


def refuse_envelope(value: Any) -> None:
    # A plain value shaped like an envelope would be taken for ciphertext when read back.
    if crypto.is_envelope(value):
        raise InvalidInput(
            f"a value may not be an object with the reserved field {crypto.ENVELOPE_MARK!r}", field="value"
        )


def decide(tenant, *, key: str, value: Any, given: bool | None, current: bool) -> bool:
    if matches_rules(tenant, key=key, value=value):
        return True
    if given is not None:
        return given
    return current


def rules(raw: Any, *, field: str) -> list[str] | None:
    """A list of sensitivity rules (key patterns or field names), validated; None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > RULES_MAX:
        raise InvalidInput(f"must be a list of at most {RULES_MAX} strings", field=field)
    out = []
    for item in raw:
        if not isinstance(item, str) or not item.strip() or len(item) > RULE_MAX_LEN:
            raise InvalidInput(
                f"each entry must be a non-empty string of at most {RULE_MAX_LEN} characters", field=field
            )
        # Neither matches anything (keys and field names hold none) nor can be stored:
        # PostgreSQL's jsonb refuses NUL and half of a UTF-16 pair (a 500 when it got there).
        if any(ord(c) < 32 or ord(c) == 127 for c in item):
            raise InvalidInput("must not contain control characters", field=field)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in item):
            raise InvalidInput(
                "must be valid Unicode: a lone surrogate (half of a UTF-16 pair) cannot be stored",
                field=field,
                code="invalid_characters",
            )
        out.append(item.strip())
    return sorted(set(out))
