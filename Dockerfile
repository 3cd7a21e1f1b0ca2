FROM python:3.11-slim
WORKDIR /srv
COPY pyproject.toml README.md celeryconfig.py ./
COPY app ./app
COPY tasks ./tasks
COPY migrations ./migrations
RUN pip install --no-cache-dir -e . gunicorn
ENV PYTHONUNBUFFERED=1
USER nobody
