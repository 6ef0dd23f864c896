# The plugin image: `hetero-gateway serve` (ext_proc gRPC on 50052, HTTP /metrics /healthz /readyz
# on 8080). Build: docker build -t hetero-gateway:0.1.0 .
# The runtime only: `plugin/`, the ext_proc stubs built from `proto/`, and the plain `pip install .` (no `demo` or `test` extra, so no Envoy
# binary, plots or tools); it is installed into a venv in a build stage and only that venv is
# copied into the final image.
# The GPU optimizer's image is the same with the `optimizer` extra (SciPy, for its solver), run as
# `hetero-gateway optimizer` (deploy/components/optimizer sets the command):
#   docker build --build-arg EXTRAS=optimizer -t hetero-gateway-optimizer:0.1.0 .
# Two tags rather than one image: SciPy and NumPy add about 200 MB that the gateway never imports,
# to every gateway pod.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/hetero-gateway
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY proto ./proto
COPY plugin ./plugin
# Extras to install, comma-separated: empty (the plugin) or `optimizer`.
ARG EXTRAS=""
# pip and setuptools only install; the running plugin imports neither.
RUN /opt/hetero-gateway/bin/pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
    && /opt/hetero-gateway/bin/pip uninstall --yes setuptools pip

FROM python:${PYTHON_VERSION}-slim
# A fixed numeric UID so Kubernetes can check runAsNonRoot (deploy/base/deployment.yaml uses it).
RUN groupadd --system --gid 10001 hetero \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin hetero
COPY --from=build /opt/hetero-gateway /opt/hetero-gateway
ENV PATH=/opt/hetero-gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 50052 8080
ENTRYPOINT ["hetero-gateway", "serve"]
