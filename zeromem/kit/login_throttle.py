"""The admin sign-in throttle: failed sign-ins are counted per client address and username
(audit/limits.py: exact across processes, in Redis or the database), and past
``ZEROMEM_ADMIN_LOGIN_FAILURES`` within ``ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS`` the sign-in
form answers 429 with ``Retry-After`` without checking the password, until the window ends.
A successful sign-in is not counted. The bucket is a digest: no username or address is
stored in the counter table."""

from __future__ import annotations

import functools
import hashlib
import math

from django.conf import settings
from django.contrib.auth.forms import UsernameField
from django.http import HttpResponse

from audit import limits
from zeromem.kit.http import client_ip

BUCKET = "adminlogin:"


def _bucket(request) -> str:
    # The name as the sign-in form looks the account up (stripped, NFKC-normalised): "ops ",
    # " ops" and a full-width "ｏｐｓ" all sign in as "ops", so they share its counter.
    username = UsernameField(max_length=150).to_python(request.POST.get("username", ""))[:150].casefold()
    digest = hashlib.sha256(f"{client_ip(request) or '-'}|{username}".encode()).hexdigest()[:32]
    return BUCKET + digest


def throttled(login_view):
    """Wrap the admin site's login view."""

    @functools.wraps(login_view)
    def login(request, *args, **kwargs):
        if request.method != "POST":
            return login_view(request, *args, **kwargs)
        window = settings.ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS
        bucket = _bucket(request)
        seen = limits.hit(bucket, window=window, cost=0)  # a look at the count, not a hit
        if seen.count >= settings.ZEROMEM_ADMIN_LOGIN_FAILURES:
            response = HttpResponse(
                "Too many failed sign-ins for this name from this address. Try again later.",
                status=429,
                content_type="text/plain; charset=utf-8",
            )
            response["Retry-After"] = str(max(1, math.ceil(seen.retry_after)))
            return response
        response = login_view(request, *args, **kwargs)
        if response.status_code == 200:  # the form again: the credentials were refused
            limits.hit(bucket, window=window)
        return response

    return login
