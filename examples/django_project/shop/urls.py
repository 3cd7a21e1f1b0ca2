from django.contrib import admin
from django.urls import include, path

from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),  # batchgen's batches, items, results, usage
    path("batchgen/", include("batchgen.integrations.django.urls")),  # the batch API
    path("shops/<str:shop>/descriptions", views.describe),
    path("shops/<str:shop>/descriptions/<str:batch_id>", views.descriptions),
]
