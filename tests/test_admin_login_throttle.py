"""The admin sign-in throttle (zeromem/kit/login_throttle.py): failed sign-ins counted per
client address and username in the shared counters (audit/limits.py, here the database);
the clock is faked, not waited for."""

import types

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from audit import limits
from audit.models import RateCounter

pytest_plugins = ["tests.admin_fixtures"]

LOGIN = "/admin/login/"


@pytest.fixture
def staff(db, fast_password_hashing, settings):
    settings.ZEROMEM_ADMIN_LOGIN_FAILURES = 3
    settings.ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS = 900
    return get_user_model().objects.create_user(username="ops", password="right-password-1", is_staff=True)


def sign_in(password, username="ops", ip="10.0.0.7"):
    return Client(REMOTE_ADDR=ip).post(LOGIN, {"username": username, "password": password, "next": "/admin/"})


def test_failed_sign_ins_past_the_limit_get_429_until_the_window_ends(staff, monkeypatch):
    clock = types.SimpleNamespace(now=1_800_000_000.0)
    monkeypatch.setattr(limits, "time", types.SimpleNamespace(time=lambda: clock.now))
    for _ in range(3):
        assert sign_in("wrong").status_code == 200  # the form again, with its error
    refused = sign_in("right-password-1")  # even the right password: not checked any more
    assert refused.status_code == 429 and 0 < int(refused["Retry-After"]) <= 900
    assert "_auth_user_id" not in refused.wsgi_request.session
    # Another name from that address, and that name from another address, are not held up.
    assert sign_in("wrong", username="someone-else").status_code == 200
    assert sign_in("right-password-1", ip="10.0.0.8").status_code == 302
    # The counter names neither the user nor the address.
    assert not RateCounter.objects.filter(bucket__contains="ops").exists()
    assert not RateCounter.objects.filter(bucket__contains="10.0.0.7").exists()
    clock.now += 900
    assert sign_in("right-password-1").status_code == 302  # a new window


def test_successful_sign_ins_are_not_counted(staff):
    for _ in range(5):
        assert sign_in("right-password-1").status_code == 302
    assert sign_in("wrong").status_code == 200


@pytest.mark.parametrize("spelling", ["ops ", " ops", "\tops\n", "ｏｐｓ", "ＯＰＳ"])
def test_another_spelling_of_the_same_name_is_counted_with_it(staff, spelling, limiter_minute):
    # limiter_minute: the throttle's 15-minute window held (a boundary between the tries let one in).
    # The sign-in form strips the name and normalises it (NFKC) before looking the account
    # up: each spelling signed in as "ops", yet each had a counter of its own, so a padded or
    # full-width name gave a password guesser another ZEROMEM_ADMIN_LOGIN_FAILURES tries per
    # spelling (hundreds of spellings per name).
    for _ in range(3):
        assert sign_in("wrong").status_code == 200
    assert sign_in("right-password-1", username=spelling).status_code == 429
    assert sign_in("wrong", username=spelling).status_code == 429
