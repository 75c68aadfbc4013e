"""How the admin pages show a moment and an actor."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.utils import timezone

from memories.models import ApiKey
from zeromem.kernel import opaque, validation
from zeromem.kernel.outcomes import ActorKind


def when(moment, empty: str = "-") -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z") if moment else empty


def actor_label(kind: str, actor_id: str) -> str:
    pk = validation.ascii_int(actor_id)
    if kind == ActorKind.STAFF and pk is not None:
        user = get_user_model().objects.filter(pk=pk).only("username").first()
        return f"staff {user.get_username()}" if user else f"staff {opaque.shown_actor_id(kind, actor_id)}"
    if kind == ActorKind.API_KEY and pk is not None:
        key = ApiKey.objects.filter(pk=pk).only("lookup").first()
        return f"key {key.display_prefix}" if key else f"key {opaque.shown_actor_id(kind, actor_id)}"
    return f"{kind} {actor_id}".strip()
