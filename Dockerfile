# CPU image of the search server (router, shard server or the embedded default).
# GPU hosts: build FROM an nvidia/cuda runtime image and `pip install .[gpu]` with a CUDA torch.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    SEARCH_DATA_DIR=/data
WORKDIR /app

# CPU torch first, so the project's torch range is met without pulling a CUDA build.
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY server ./server
COPY index_builder ./index_builder
RUN pip install --no-cache-dir . && python -c "import server.rpc"

RUN useradd --create-home --uid 10001 search && mkdir -p /data && chown search /data
USER search
VOLUME ["/data"]
EXPOSE 50051 50061 9100

# Default: the embedded default over every published collection in /data.
# Shard server:  search-server shard --data-dir /data --collection C --shard 0 --host 0.0.0.0 --port 50061
# Router:        search-server router --topology /etc/search/topology.json --host 0.0.0.0
ENTRYPOINT ["search-server"]
CMD ["serve", "--data-dir", "/data", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
