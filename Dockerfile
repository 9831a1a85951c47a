# The project's own services (workers, beat, Flower). SGLang runs from its own image.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first: this layer is rebuilt only when the pins change.
COPY requirements.txt .
RUN pip install -r requirements.txt

# The code. Named paths rather than `COPY . .`: a developer checkout holds a .venv, output/ and
# test artifacts that must not end up in the image.
COPY manage.py celeryconfig.py pyproject.toml ./
COPY dflash_tasks/ dflash_tasks/
COPY workers/ workers/

# Not root; /data/output exists and belongs to the app user, so a fresh named volume mounted
# there inherits that ownership.
RUN useradd --create-home --uid 1000 app && mkdir -p /data/output && chown -R app /data
USER app
ENV DFLASH_OUTPUT_DIR=/data/output

CMD ["python", "manage.py", "--help"]
