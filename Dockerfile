# The tether agent server (and, with bubblewrap inside, a device) in a container.
#   docker build -t tether .
#   docker run --rm -v tether-state:/var/lib/tether tether token create --api admin --scope admin   # first: an admin token
#   docker run -d -p 127.0.0.1:8765:8765 -v tether-state:/var/lib/tether tether
# Off loopback the server refuses to start until a token exists, and wants TLS: mount a certificate and
# add --tls-cert/--tls-key, or keep --allow-insecure only behind a proxy that terminates TLS.
FROM debian:bookworm-slim

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates bubblewrap \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tether
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir . && rm -rf /opt/tether/src

RUN useradd --system --create-home --home-dir /var/lib/tether --shell /usr/sbin/nologin tether
ENV PATH=/opt/venv/bin:$PATH TETHER_STATE_DIR=/var/lib/tether PYTHONUNBUFFERED=1
USER tether
VOLUME ["/var/lib/tether"]
EXPOSE 8765
HEALTHCHECK --interval=30s --timeout=5s \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/api/v1/health', timeout=4)"]
ENTRYPOINT ["tether"]
CMD ["server", "--host", "0.0.0.0", "--port", "8765", "--allow-insecure"]
