#!/usr/bin/env python
"""A minimal Django project using batchgen's reusable app.

python examples/django_project/manage.py check
python examples/django_project/manage.py runserver
python examples/django_project/manage.py batchgen_submit requests.jsonl --tenant acme
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
