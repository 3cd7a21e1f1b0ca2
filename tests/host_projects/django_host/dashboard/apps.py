from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The host's own app named ``dashboard``."""

    name = "dashboard"

    def ready(self) -> None:
        from dashboard import receivers  # noqa: F401  (connects them)
