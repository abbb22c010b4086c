"""The Django app of test_fork.py, as the guide sets it up, loaded by gunicorn's master
(``--preload``) before it forks its workers: the limiter is made, and used once, in the
master. FORKED_STORE and FORKED_NAME say which store and limit (3 an hour)."""

from __future__ import annotations

import os

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import path

from pytollgate import HOUR, RateLimiter

NAME = os.environ["FORKED_NAME"]
limiter = RateLimiter(
    os.environ["FORKED_STORE"],
    limits={NAME: {"kind": "fixed window", "rate": 3, "period": HOUR, "start": 0}},
    store_deadline=2.0,
)
# The master's runtime is running and its connection open when the workers are forked.
limiter.check(NAME, key="master")


def hello(_request: HttpRequest) -> HttpResponse:
    return HttpResponse("hello")


urlpatterns = [path("", hello)]

settings.configure(
    DEBUG=False,
    ALLOWED_HOSTS=["127.0.0.1"],
    ROOT_URLCONF=__name__,
    MIDDLEWARE=["pytollgate.django.RateLimitMiddleware"],
    SECRET_KEY="test",
    TOLLGATE={"limiter": limiter, "limits": NAME},  # keyed by "ip"
)
django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
