"""``path("batchgen/", include("batchgen.integrations.django.urls"))`` mounts the batch API."""

from __future__ import annotations

from django.urls import re_path

from batchgen.integrations.django.views import api

app_name = "batchgen"

urlpatterns = [re_path(r"^(?P<subpath>.*)$", api, name="api")]
