from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def show_dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard.html")
