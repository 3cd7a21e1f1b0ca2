"""The host site's settings: batchgen's app beside the host's own ``dashboard`` app."""

import os
from pathlib import Path

# The test runs batchgen's processes in this folder: none of them may import this.
if os.environ.get("HOST_MARKS"):
    Path(os.environ["HOST_MARKS"], f"{Path(__file__).parent.name}.{__name__}").touch()

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "host-site-tests"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1"]
ROOT_URLCONF = "host_site.urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "batchgen.integrations.django",
    "dashboard",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {},
    }
]
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True
# batchgen's database, Redis and callback settings come from the environment.

# The site's own Celery app (host_site/celery.py) reads these, on its own broker.
CELERY_BROKER_URL = os.environ["HOST_BROKER_URL"]
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "django_host"
