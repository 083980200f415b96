"""ServerConfig: the server's flags, as `servelm serve` and `build_app` take them.

Owns: the server options and their defaults (the serve flags' defaults read from here).
Never: imports FastAPI or torch: `servelm serve --help` builds its flags from this class.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_n: int = 16
    max_queue: int = 1024
    request_timeout: float | None = None  # seconds; None: no default deadline
    drain_timeout: float = 30.0
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    # The SLO spec file (servelm/slo.py, docs/slo.md): request classes; None: one class from
    # slo_ttft_ms / slo_tpot_ms.
    slo_spec: str | None = None
    max_body_bytes: int = 8 * 2**20
    write_timeout: float = 30.0  # a stream reader stalled this long is dropped
    retry_after_s: int = 1
    idempotency_ttl_s: float = 600.0
    idempotency_max_entries: int = 1024
    peak_bandwidth: float | None = None  # bytes/s
    peak_flops: float | None = None  # FLOP/s
    # Request and connection limits (docs/server.md, "Limits"); the CLI's defaults are these.
    max_prompts: int = 64  # prompts in one completion request
    max_choices: int = 256  # n x prompts in one request
    header_timeout: float = 10.0  # seconds for a request line and headers to arrive
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 1024  # open connections; more are answered 503 and closed
    # Images in chat content parts (docs/vision.md): encoded size, width x height, images in
    # one request, and the hosts whose https images may be fetched (none: data: URLs only).
    max_image_bytes: int = 6 * 2**20
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    allowed_image_hosts: tuple[str, ...] = ()
    # Chat output parsers, by name (servelm/parsers/): tool calls in the model's format, and
    # thinking in tags (None: the output is all content).
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    # Observability (docs/observability.md): each finished request's record appended to this
    # JSON-lines file (`servelm doctor --log`), and OpenTelemetry spans sent over OTLP/HTTP.
    request_log: str | None = None
    otlp_traces_endpoint: str | None = None
    # Where responses, files and batches are kept (servelm/server/state_store.py):
    # sqlite:///PATH or postgresql://USER@HOST/DB; None: $SERVELM_HOME/state.sqlite3.
    state_store: str | None = None
    # Files and Batches (docs/server.md): an uploaded file's size, requests in one batch,
    # batches not yet finished (all replicas sharing the store), and the batch lines this
    # replica keeps in the engine at once (submitted only while nothing else waits).
    max_file_bytes: int = 200 * 2**20
    max_batch_lines: int = 50_000
    max_active_batches: int = 100
    batch_max_inflight: int = 8
    # Per tenant (the OpenAI-Project header, else the API key: servelm/server/batch_quota.py):
    # uploaded files, their bytes, batches not yet finished; 0: no limit
    quota_files: int = 1000
    quota_file_bytes: int = 10 * 2**30
    quota_active_batches: int = 20

    def __post_init__(self):
        for name in ("max_file_bytes", "max_batch_lines", "max_active_batches",
                     "batch_max_inflight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got "
                                 f"{value!r}")
        _ = self.tenant_quota  # a bad quota fails here, naming its flag

    @property
    def tenant_quota(self):
        from servelm.server.batch_quota import TenantQuota

        return TenantQuota(self.quota_files, self.quota_file_bytes, self.quota_active_batches)

    def load_slo_spec(self):
        """The server's SLO spec: the --slo-spec file, else the TTFT/TPOT flags' one class."""
        from servelm.slo import spec_from_flags

        return spec_from_flags(self.slo_spec, self.slo_ttft_ms, self.slo_tpot_ms)
