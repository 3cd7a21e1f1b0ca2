from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard.tasks import ping


def show_dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard.html")


def send_ping(request: HttpRequest) -> HttpResponse:
    """Sends the site's ``ping`` task from a request."""
    ping.delay("web")
    return HttpResponse("sent")
