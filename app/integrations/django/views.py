"""The batch API inside Django: the request is handed, as WSGI, to the same Flask
blueprint that serves the standalone API, so answers are identical by construction
(status, headers, error JSON, streamed results).

The body is passed as a stream (nothing is read into memory here), and the
view is CSRF-exempt: API callers authenticate with a bearer key, not a cookie.

The dashboard below the mount follows the site's own login: the view is a Django
view, so the request has passed the site's middleware; a signed-in staff user
(``is_staff``) gets the dashboard's operator view (the bridge hands the Flask app
the user's name in the WSGI environ, a key no client can set), and an anonymous
visitor of a dashboard page is sent to ``settings.LOGIN_URL``. Others sign in with
an API key as on the standalone dashboard.

The admin API below the mount (``admin/v1/...``) takes a staff user's session the
same way (as ``django:<username>`` in the audit log), its changes behind Django's
CSRF check since a cookie authenticates them; a request with an ``Authorization``
header is judged by its key alone.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from flask import Flask

# Headers that belong to one hop; the Django server sets its own.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
)


@functools.cache
def wsgi_app() -> Flask:
    """The API as a WSGI app of its own (the host's logging is left alone)."""
    from batchgen.admin_api import admin_blueprint
    from batchgen.api import blueprint, install_error_handlers
    from batchgen.dashboard import dashboard

    api_app = Flask("batchgen.django")
    api_app.register_blueprint(blueprint)
    api_app.register_blueprint(dashboard)
    api_app.register_blueprint(admin_blueprint)
    install_error_handlers(api_app)  # every answer below the mount is JSON, errors too
    return api_app


def _wsgi_str(text: str) -> str:
    # WSGI carries paths as latin-1 decoded bytes.
    return text.encode("utf-8").decode("latin-1")


def wsgi_environ(request: HttpRequest, subpath: str) -> dict[str, Any]:
    """A WSGI environ for the API app: ``PATH_INFO`` is the path below the mount."""
    meta = request.META
    full = request.path_info
    mount = full[: len(full) - len(subpath)].rstrip("/")
    environ: dict[str, Any] = {k: v for k, v in meta.items() if isinstance(v, str)}
    environ.update(
        {
            "REQUEST_METHOD": request.method or "GET",
            "SCRIPT_NAME": _wsgi_str(str(meta.get("SCRIPT_NAME", "")) + mount),
            "PATH_INFO": _wsgi_str("/" + subpath),
            "QUERY_STRING": str(meta.get("QUERY_STRING", "")),
            "SERVER_NAME": str(meta.get("SERVER_NAME", "localhost")),
            "SERVER_PORT": str(meta.get("SERVER_PORT", "80")),
            "SERVER_PROTOCOL": str(meta.get("SERVER_PROTOCOL", "HTTP/1.1")),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": request.scheme,
            # Django's request is a file-like view of the body, bounded by its length.
            "wsgi.input": request,
            "wsgi.input_terminated": True,
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
    )
    return environ


def call_wsgi(
    app: Callable[..., Iterable[bytes]], environ: dict[str, Any]
) -> HttpResponse | StreamingHttpResponse:
    """Run a WSGI app and turn its answer into a Django response (streamed if it streams)."""
    started: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started["status"], started["headers"] = status, headers
        return lambda data: None  # the write() callable; Flask never uses it

    body = app(environ, start_response)
    code, _, reason = started["status"].partition(" ")
    headers = [(k, v) for k, v in started["headers"] if k.lower() not in HOP_BY_HOP]
    response: HttpResponse | StreamingHttpResponse
    if any(k.lower() == "content-length" for k, _ in headers):
        try:
            response = HttpResponse(b"".join(body), status=int(code), reason=reason or None)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
    else:  # a stream (results): Django iterates, then closes it
        response = StreamingHttpResponse(body, status=int(code), reason=reason or None)
    for key, value in headers:
        if key.lower() == "set-cookie":  # several of them: Django keeps cookies apart
            response.cookies.load(value)
        else:
            response[key] = value
    return response


def _dashboard_page(subpath: str) -> bool:
    return subpath == "dashboard" or subpath.startswith("dashboard/")


def _admin_api(subpath: str) -> bool:
    return subpath.startswith("admin/v1/")


def _csrf_refusal(request: HttpRequest) -> HttpResponse | None:
    """Django's own CSRF check, for a change the staff user's session cookie (not a
    bearer key) authenticates: a 403 answer when it fails."""
    from django.middleware.csrf import CsrfViewMiddleware

    refused = CsrfViewMiddleware(lambda r: HttpResponse()).process_view(
        request, lambda r: HttpResponse(), (), {}
    )
    return refused if isinstance(refused, HttpResponse) else None


@csrf_exempt
def api(request: HttpRequest, subpath: str) -> HttpResponse | StreamingHttpResponse:
    """Every API route below the include's prefix."""
    from batchgen.dashboard_auth import OPERATOR_ENVIRON_KEY

    environ = wsgi_environ(request, subpath)
    environ.pop(OPERATOR_ENVIRON_KEY, None)  # only this bridge says who the operator is
    user = getattr(request, "user", None)  # None: the site has no auth middleware
    staff = user is not None and user.is_authenticated and user.is_active and user.is_staff
    if (
        staff
        and user is not None
        and _admin_api(subpath)
        and "HTTP_AUTHORIZATION" not in request.META
    ):
        # The admin API as the signed-in staff user: a cookie authenticates the
        # request, so a change must pass Django's CSRF check.
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            refused = _csrf_refusal(request)
            if refused is not None:
                return refused
        environ[OPERATOR_ENVIRON_KEY] = user.get_username()
        return call_wsgi(wsgi_app(), environ)
    if user is not None and _dashboard_page(subpath):
        if user.is_authenticated and user.is_active and user.is_staff:
            environ[OPERATOR_ENVIRON_KEY] = user.get_username()
        elif not user.is_authenticated and request.method in ("GET", "HEAD"):
            from django.contrib.auth.views import redirect_to_login  # auth is installed

            return redirect_to_login(request.get_full_path())  # settings.LOGIN_URL
    return call_wsgi(wsgi_app(), environ)
