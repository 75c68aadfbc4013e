"""The end-user portal: the pages a tenant's end user reaches through a portal link.

No JavaScript, no CDN: server-rendered pages with forms (CSRF-protected by Django's
middleware). Who is asking is the link, then the portal session cookie it was exchanged
for (signed, ``/portal/`` only, HttpOnly, SameSite=Strict, ``ZEROMEM_PORTAL_SESSION_SECONDS``); every page
builds the end-user actor from it and calls the services, which check that the subject is
the actor's own and write the audit events.
"""

from __future__ import annotations

import functools
import math
from urllib.parse import urlencode

from django.conf import settings
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from audit.services import AuthThrottled
from memories.models import ForgetRequest
from memories.portal import presentation
from memories.portal.models import PortalLink
from memories.portal.services import LinkRefused, portal_link_open, portal_session_link, portal_sign_out
from memories.services import subjects
from zeromem.kernel import opaque
from zeromem.kernel.actors import Actor
from zeromem.kernel.errors import Forbidden, InvalidInput, NotFound, TenantBusy
from zeromem.kernel.outcomes import ActorKind
from zeromem.kernel.scopes import Scope
from zeromem.kit.http import client_ip

COOKIE = "zm_portal"
COOKIE_SALT = "zeromem.portal.session"
COOKIE_PATH = "/portal/"
COOKIE_SAMESITE = "Strict"
SESSION_PURPOSE = "portal-session"
END_USER_SCOPES = frozenset({Scope.MEMORY_READ, Scope.FORGET_CREATE})
PENDING = (ForgetRequest.Status.RECEIVED, ForgetRequest.Status.RUNNING)
# A page showing a pending request reloads itself (a meta refresh: no script), after 2 s, then
# twice as long each time up to 60 s, REFRESH_LOADS times (6 min 2 s in all), then offers a
# "Check again" link: each load is 2 audit rows, so a tab left open writes at most 22 (it
# reloaded every 2 s for as long as the request was pending: ~1,800 rows in 30 minutes with
# the workers stalled). The count of reloads so far rides in the reload's URL (?refresh=n).
REFRESH_FIRST_SECONDS = 2
REFRESH_MAX_SECONDS = 60
REFRESH_LOADS = 10

REFUSED_LINK = {
    "altered": (
        "This link does not work",
        "It may have been copied incompletely or changed on the way. Ask the app that sent it for a new link.",
    ),
    "expired": (
        "This link has expired",
        "Links to this page work for a short time only. Ask the app that sent it for a new link.",
    ),
    "revoked": (
        "This link was withdrawn",
        "The app that sent it withdrew it. Ask the app for a new link to see what is remembered about you.",
    ),
    "replayed": (
        "This link has already been used",
        "Each link opens the page once. If that was not you, tell the app that sent it. "
        "Ask the app for a new link to see your page again.",
    ),
}


def end_user_actor(request, link: PortalLink) -> Actor:
    """The end user of a portal link, as the services and the audit log see them."""
    return Actor(
        kind=ActorKind.END_USER,
        id=subjects.end_user_actor_id(link.subject),
        label="end user",
        scopes=END_USER_SCOPES,
        surface="portal",
        request_id=getattr(request, "request_id", ""),
        client_ip=client_ip(request),
    )


def _link_holder(request) -> Actor:
    # Whoever holds a link that is refused: not known to be the end user.
    return Actor(
        kind=ActorKind.ANONYMOUS,
        label="portal link",
        surface="portal",
        request_id=getattr(request, "request_id", ""),
        client_ip=client_ip(request),
    )


def _error(request, status: int, title: str, message: str, *, has_session: bool = False) -> HttpResponse:
    context = {"title": title, "message": message, "has_session": has_session}
    return render(request, "portal/error.html", context, status=status)


def _session_link(request, *, count: bool = True) -> PortalLink | None:
    """The session's link; raises AuthThrottled past the session's pages per minute
    (``count``; see :func:`_pages`)."""
    raw = request.get_signed_cookie(
        COOKIE, default=None, salt=COOKIE_SALT, max_age=settings.ZEROMEM_PORTAL_SESSION_SECONDS
    )
    # The cookie is signed, not enciphered: it holds the link's opaque token, not its row id
    # (a sequence every tenant's links share).
    link_id = opaque.open_id(raw, purpose=SESSION_PURPOSE)
    return portal_session_link(link_id=link_id, count=count) if link_id else None


def _too_many(request, retry_after: float, message: str) -> HttpResponse:
    response = _error(request, 429, "Too many attempts", message)
    response["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return response


def _sent_by_another_site(request) -> bool:
    """Whether the browser says (Fetch Metadata, ``Sec-Fetch-*``: Chromium 76+, Firefox 90+,
    Safari 16.4+) that another site made it load this page: an ``<img>``, ``<iframe>`` or
    ``<script>`` there (``Sec-Fetch-Site: cross-site``, ``Sec-Fetch-Mode: no-cors``), or a link
    or script navigating the window (``cross-site``, ``navigate``); a sibling subdomain is
    ``same-site``. The user's own clicks, reloads, typed URLs and our redirects and refreshes
    are ``same-origin`` or ``none`` with ``navigate``. A browser sending none of it is let
    through: the session cookie (``SameSite=Strict``) is not sent cross-site anyway."""
    site = request.headers.get("Sec-Fetch-Site")
    mode = request.headers.get("Sec-Fetch-Mode")
    return site in ("cross-site", "same-site") or (mode is not None and mode != "navigate")


def _pages(view):
    """A session page: past ``ZEROMEM_PORTAL_PAGES_PER_MINUTE`` of its session, a 429 page
    with Retry-After, and nothing read or written. Loaded on another site's behalf
    (:func:`_sent_by_another_site`), the no-session page, and nothing read, counted or
    written: each page is an audit row in the tenant's append-only log."""

    @functools.wraps(view)
    def page(request, *args, **kwargs):
        if _sent_by_another_site(request):
            return _no_session(request)
        try:
            return view(request, *args, **kwargs)
        except AuthThrottled as exc:
            message = "This page was loaded too often in the last minute. Wait a minute."
            return _too_many(request, exc.retry_after, message)

    return page


def _no_session(request) -> HttpResponse:
    return _error(
        request,
        403,
        "Please open a new link",
        "This page needs a link from the app you use, and your visit has ended or was never started. "
        "Ask the app for a new link to see what is remembered about you.",
    )


def _service_error(request, exc) -> HttpResponse:
    if isinstance(exc, Forbidden):
        return _error(request, 403, "Not allowed", exc.message)
    return _error(request, 400, "Something in this request was not right", f"{exc.field or 'input'}: {exc.message}")


@never_cache
@require_http_methods(["GET", "HEAD", "POST"])
def link_open(request, token):
    """GET shows the link's landing page without using the link up (link previews fetch
    it); POST, the page's button, opens it: the link is spent and a portal session starts."""
    use = request.method == "POST"
    try:
        link = portal_link_open(
            token=token,
            actor_for=lambda link: end_user_actor(request, link) if link else _link_holder(request),
            use=use,
        )
    except LinkRefused as exc:
        title, message = REFUSED_LINK[exc.reason]
        return _error(
            request, exc.http_status, title, message, has_session=_session_link(request, count=False) is not None
        )
    except AuthThrottled as exc:
        message = "Too many links that do not work were opened from here. Wait a minute."
        return _too_many(request, exc.retry_after, message)
    if not use:
        response = render(request, "portal/open.html", {"tenant": link.tenant})
        # The token is in this page's URL: never sent to another site. (Not "no-referrer":
        # the button's POST would then carry "Origin: null" and fail Django's CSRF check.)
        response["Referrer-Policy"] = "same-origin"
        return response
    response = HttpResponseRedirect(reverse("portal-home"))
    response.set_signed_cookie(
        COOKIE,
        opaque.seal_id(link.pk, purpose=SESSION_PURPOSE),
        salt=COOKIE_SALT,
        max_age=settings.ZEROMEM_PORTAL_SESSION_SECONDS,
        path=COOKIE_PATH,
        secure=settings.SESSION_COOKIE_SECURE,
        httponly=True,
        # Never sent on a request another site starts, a link followed from there included
        # (Lax sends it on those): the Continue button's POST and its redirect are ours.
        samesite=COOKIE_SAMESITE,
    )
    return response


@never_cache
@require_http_methods(["GET", "HEAD"])
@_pages
def home(request):
    link = _session_link(request)
    if link is None:
        return _no_session(request)
    actor = end_user_actor(request, link)
    start = request.GET.get("start")
    try:
        memories, total = subjects.subject_memories(tenant=link.tenant, actor=actor, subject=link.subject, start=start)
    except InvalidInput as exc:
        return _service_error(request, exc)
    requests = subjects.subject_forget_requests(tenant=link.tenant, actor=actor, subject=link.subject)
    return _home(request, link, memories, total, requests, start=int(start or 0))


def _home(
    request, link, memories, total, requests, *, start: int = 0, error: str = "", status: int = 200
) -> HttpResponse:
    items = [
        {
            "key": m.key,
            "label": presentation.key_label(m.key),
            "kind": presentation.category_label(m.category),
            "value": presentation.readable_value(m.value),
            "updated_at": m.updated_at,
            "created_at": m.created_at,
            "source": m.source,  # who wrote it: the app's own name for the writer, or its key
            "expires_at": m.expires_at,
        }
        for m in memories
    ]
    context = {
        "tenant": link.tenant,
        "memories": items,
        "total": total,
        # Where this page of memories starts and ends (1-based), and where the next one starts.
        "first": start + 1,
        "last": start + len(items),
        "next_start": start + len(items) if start + len(items) < total else None,
        "requests": [_request_view(r) for r in requests],
        "error": error,
        "refresh": _refresh(request, any(r.status in PENDING for r in requests)),
    }
    return render(request, "portal/home.html", context, status=status)


def _refresh(request, pending: bool) -> dict | None:
    """How a page showing a pending request reloads itself: ``{"seconds", "url"}`` for its
    meta refresh, or ``{"stopped": True, "url"}`` (a "Check again" link) once it has reloaded
    itself REFRESH_LOADS times; None when nothing is pending. A count in the URL that is not
    one of 1..REFRESH_LOADS is the first load's."""
    if not pending:
        return None
    raw = request.GET.get("refresh", "")
    done = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 3 else 0
    if not 0 < done <= REFRESH_LOADS:
        done = 0
    # The page of memories being looked at (a start the page accepted) stays in the reload's URL.
    start = {"start": request.GET["start"]} if request.GET.get("start") else {}
    if done == REFRESH_LOADS:
        return {"stopped": True, "url": f"{request.path}?{urlencode(start)}" if start else request.path}
    seconds = min(REFRESH_FIRST_SECONDS * 2**done, REFRESH_MAX_SECONDS)
    return {"seconds": seconds, "url": f"{request.path}?{urlencode({**start, 'refresh': done + 1})}"}


@never_cache
@require_http_methods(["POST"])
@_pages
def forget(request):
    """One memory (``what=one``, ``key``) or everything (``what=all`` with ``confirm=yes``)."""
    link = _session_link(request)
    if link is None:
        return _no_session(request)
    actor = end_user_actor(request, link)
    what = request.POST.get("what")
    try:
        if what == "all":
            if request.POST.get("confirm") != "yes":
                memories, total = subjects.subject_memories(tenant=link.tenant, actor=actor, subject=link.subject)
                requests = subjects.subject_forget_requests(tenant=link.tenant, actor=actor, subject=link.subject)
                error = "Tick the box to confirm that everything should be forgotten."
                return _home(request, link, memories, total, requests, error=error, status=400)
            forget_request = subjects.subject_forget(tenant=link.tenant, actor=actor, subject=link.subject)
        elif what == "one":
            forget_request = subjects.subject_forget(
                tenant=link.tenant, actor=actor, subject=link.subject, key=request.POST.get("key", "")
            )
        else:
            return _error(request, 400, "Something in this request was not right", "what: choose one or all")
    except NotFound:
        return _error(
            request,
            404,
            "Nothing to forget there",
            "That memory is not among the ones kept about you (it may be gone already).",
        )
    except (InvalidInput, Forbidden) as exc:
        return _service_error(request, exc)
    except TenantBusy as exc:  # the tenant's pending forget requests are at their cap
        message = "Too many requests to forget are waiting to be carried out here right now. Try again in a minute."
        return _too_many(request, exc.extra.get("retry_after", 10), message)
    return HttpResponseRedirect(reverse("portal-request", kwargs={"request_id": forget_request.uid}))


@never_cache
@require_http_methods(["GET", "HEAD"])
@_pages
def request_detail(request, request_id):
    link = _session_link(request)
    if link is None:
        return _no_session(request)
    actor = end_user_actor(request, link)
    try:
        forget_request = subjects.subject_forget_request_get(
            tenant=link.tenant, actor=actor, subject=link.subject, request_id=request_id
        )
    except NotFound:
        return _error(request, 404, "No such request", "There is no request of yours with this reference.")
    view = _request_view(forget_request)
    context = {"tenant": link.tenant, "r": view, "refresh": _refresh(request, view["pending"])}
    return render(request, "portal/request.html", context)


@never_cache
@require_http_methods(["POST"])
def sign_out(request):
    link = _session_link(request, count=False)  # always possible: it ends the session
    if link is not None:
        portal_sign_out(link=link, actor=end_user_actor(request, link))
    response = render(request, "portal/signed_out.html")
    response.delete_cookie(COOKIE, path=COOKIE_PATH, samesite=COOKIE_SAMESITE)
    return response


STEPS = [
    (ForgetRequest.Status.RECEIVED, "Received"),
    (ForgetRequest.Status.RUNNING, "Being carried out"),
    (ForgetRequest.Status.COMPLETED, "Done"),
]


def _request_view(r: ForgetRequest) -> dict:
    """A forget request as the page shows it: what, where it stands, and its receipt."""
    if r.subject:
        what = "Everything remembered about you"
    elif r.keys:
        labels = [presentation.key_label(k) for k in r.keys]
        what = f"One memory: {labels[0]}" if len(labels) == 1 else f"{len(labels)} memories"
    else:
        what = "Memories under one heading"
    order = [s for s, _ in STEPS]
    reached = order.index(r.status) if r.status in order else -1
    receipt = r.receipt or {}
    return {
        "id": str(r.uid),  # never the row id: a sequence every tenant's requests share
        "what": what,
        "status": r.status,
        "status_label": dict(STEPS).get(r.status, "Could not be completed"),
        "steps": [{"label": label, "done": i <= reached} for i, (_, label) in enumerate(STEPS)],
        "failed": r.status == ForgetRequest.Status.FAILED,
        "pending": r.status in PENDING,
        "created_at": r.created_at,
        "started_at": r.started_at,
        "completed_at": r.completed_at,
        "due_at": r.due_at,
        "receipt": {
            "memories": receipt.get("memories", 0),
            "versions": receipt.get("versions", 0),
            "summaries": receipt.get("summaries", 0),
            # Shared summaries (about other people too) lose only this user's part.
            "summaries_rebuilt": len(receipt.get("summaries_rebuilt", [])),
        }
        if r.status == ForgetRequest.Status.COMPLETED
        else None,
    }
