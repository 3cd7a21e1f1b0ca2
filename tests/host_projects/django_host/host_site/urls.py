from dashboard import views
from django.urls import include, path

urlpatterns = [
    path("llm/", include("batchgen.integrations.django.urls")),
    path("dashboard/", views.show_dashboard),
    path("ping/", views.send_ping),
]
