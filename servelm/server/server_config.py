"""ServerConfig: the server's options, as `servelm serve` and `build_app` take them.

Owns: the server options, their defaults and their flags (each field an `option()`:
servelm/config/option.py; `servelm serve` builds its server flags from these fields).
Never: imports FastAPI or torch: `servelm serve --help` builds its flags from this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.config.option import no_flag, option


def _server(default, help, **flag):
    return option(default, help, group="server", **flag)


def _peak_help(index: int, what: str):
    def text() -> str:
        from servelm.planner.hardware import default_peaks

        cpu, gpu = default_peaks("cpu")[index], default_peaks("cuda")[index]
        return f"{what} (default: {cpu:g} on CPU, {gpu:g} on CUDA)"
    return text


def _tool_parsers() -> list[str]:
    from servelm.parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def _reasoning_parsers() -> list[str]:
    from servelm.parsers import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


def _quota_help(what: str) -> str:
    return (f"{what} per tenant: the OpenAI-Project header, else the API key (429 beyond; "
            "0: no limit)")


@dataclass(frozen=True)
class ServerConfig:
    host: str = _server("127.0.0.1", "bind address (default 127.0.0.1)")
    port: int = _server(8000, "the HTTP port (default %(default)s)")
    # None only on the command line, where it means the model's name
    served_model_name: str | None = _server(
        None, "the name clients use in `model` (default: the model's name)")
    api_key: str | None = _server(
        None, "require 'Authorization: Bearer KEY' on every route but /health and the "
              "dashboard page (default: $SERVELM_API_KEY)")
    max_n: int = _server(16, "largest n accepted")
    max_queue: int = _server(1024, "waiting requests before new ones get 429")
    request_timeout: float | None = _server(  # seconds; None: no default deadline
        None, "default per-request deadline in seconds (the `timeout` header overrides it)")
    drain_timeout: float = _server(30.0, "seconds in-flight requests may run after SIGTERM")
    slo_ttft_ms: float = _server(1000.0, "the time-to-first-token target of the one SLO "
                                         "class without --slo-spec, in ms")
    slo_tpot_ms: float = _server(100.0, "the time-per-output-token target of the one SLO "
                                        "class without --slo-spec, in ms")
    # The SLO spec file (servelm/slo.py, docs/slo.md): request classes; None: one class from
    # slo_ttft_ms / slo_tpot_ms.
    slo_spec: str | None = _server(
        None, "SLO classes (JSON, docs/slo.md): the targets requests name with `priority` / "
              "`slo_class`, the per-class goodput gauges and the slo scheduling policy read "
              "it; replaces --slo-ttft-ms / --slo-tpot-ms", metavar="FILE")
    max_body_bytes: int = _server(8 * 2**20, "largest request body in bytes (413 beyond)")
    write_timeout: float = _server(  # a stream reader stalled this long is dropped
        30.0, "seconds a stream reader may stall before it is dropped")
    retry_after_s: int = no_flag(1)
    idempotency_ttl_s: float = no_flag(600.0)
    idempotency_max_entries: int = no_flag(1024)
    peak_bandwidth: float | None = _server(  # bytes/s
        None, _peak_help(0, "bytes/s for bandwidth utilisation"))
    peak_flops: float | None = _server(  # FLOP/s
        None, _peak_help(1, "FLOP/s for compute utilisation"))
    # Request and connection limits (docs/server.md, "Limits").
    max_prompts: int = _server(64, "prompts in one completion request; more get a 400 naming "
                                   "`prompt` (default %(default)s)")
    max_choices: int = _server(256, "n x prompts in one request; more get a 400 naming `n` "
                                    "(default %(default)s)")
    header_timeout: float = _server(10.0, "seconds a connection may take to send a request "
                                          "line and headers before it is closed (default "
                                          "%(default)s)")
    keep_alive_timeout: float = _server(5.0, "seconds an idle keep-alive connection stays "
                                             "open (default %(default)s)")
    max_connections: int = _server(1024, "open connections; a connection beyond it gets a 503 "
                                         "and is closed (default %(default)s)")
    # Images in chat content parts (docs/vision.md): encoded size, width x height, images in
    # one request, and the hosts whose https images may be fetched (none: data: URLs only).
    max_image_bytes: int = _server(6 * 2**20, "vision models: the largest image (encoded "
                                              "bytes) a content part may carry (default "
                                              "%(default)s)")
    max_image_pixels: int = _server(4096 * 4096, "vision models: the largest width x height of "
                                                 "one image, checked before decoding (default "
                                                 "%(default)s)")
    max_images_per_request: int = _server(8, "vision models: images in one request, at most "
                                             "(default %(default)s)")
    allowed_image_hosts: tuple[str, ...] = _server(
        (), "hosts whose https:// image URLs the server may fetch (default: none; images come "
            "as data: URLs)", metavar="HOST,...", parse="host_list")
    # Chat output parsers, by name (servelm/parsers/): tool calls in the model's format, and
    # thinking in tags (None: the output is all content).
    tool_call_parser: str = _server(
        "hermes", "the format the model writes tool calls in, read into tool_calls "
                  "(tool_choice auto; docs/server.md)", choices=_tool_parsers)
    reasoning_parser: str | None = _server(
        None, "read <think> output into reasoning_content (default: none)",
        choices=_reasoning_parsers)
    # Observability (docs/observability.md): each finished request's record appended to this
    # JSON-lines file (`servelm doctor --log`), and OpenTelemetry spans sent over OTLP/HTTP.
    request_log: str | None = _server(
        None, "append each finished request's timing record (queue, prefill, stalls, client) "
              "to FILE as JSON lines, for `servelm doctor --log`", metavar="FILE")
    otlp_traces_endpoint: str | None = _server(
        None, "send OpenTelemetry spans per request (front end, queue, prefill, decode, "
              "stream) to this OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318/v1/traces "
              "(needs servelm[otel]; default: off)", metavar="URL")
    # Where responses, files and batches are kept (servelm/server/state_store.py):
    # sqlite:///PATH or postgresql://USER@HOST/DB; None: $SERVELM_HOME/state.sqlite3.
    state_store: str | None = _server(
        None, "where responses, files and batches are kept: sqlite:///PATH (a file shared by "
              "the replicas of this machine; default $SERVELM_HOME/state.sqlite3) or "
              "postgresql://USER@HOST/DB (replicas on several machines; needs "
              "servelm[postgres])", metavar="URL")
    # Files and Batches (docs/server.md): an uploaded file's size, requests in one batch,
    # batches not yet finished (all replicas sharing the store), and the batch lines this
    # replica keeps in the engine at once (submitted only while nothing else waits).
    max_file_bytes: int = _server(200 * 2**20, "largest file POST /v1/files takes (413 beyond)")
    max_batch_lines: int = _server(50_000, "requests in one batch's input file (the batch "
                                           "fails beyond)")
    max_active_batches: int = _server(100, "batches not yet finished in the state store (429 "
                                           "beyond)")
    # Per tenant (the OpenAI-Project header, else the API key: servelm/server/batch_quota.py):
    # uploaded files, their bytes, batches not yet finished; 0: no limit
    quota_files: int = _server(1000, _quota_help("uploaded files not deleted"))
    quota_file_bytes: int = _server(10 * 2**30, _quota_help("bytes of uploaded files"))
    quota_active_batches: int = _server(20, _quota_help("batches not yet finished"))
    batch_max_inflight: int = _server(
        8, "batch lines this replica keeps in the engine at once (each enters only while no "
           "other request waits, or when its batch's window needs it)")
    log_requests: bool = _server(True, "one JSON line per finished request on stderr (logger "
                                       "servelm.requests)", negatable=True)

    def __post_init__(self):
        if self.served_model_name is None:
            raise ValueError("served_model_name is required: the name clients use in `model`")
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
