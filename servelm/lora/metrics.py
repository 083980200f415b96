"""LoraMetrics: the server's Prometheus series about LoRA adapters.

Owns: requests, prompt and generated tokens per adapter (recorded when a request ends, from
the front end's view of it), adapter loads into slots and evictions (from the engine's
StepReport counters), and gauges of adapters registered and resident. Registered on the
server's own registry (servelm/server/metrics.py ServerMetrics.registry).
Never: touches the engine; it reads what the front end already has.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class LoraMetrics:
    def __init__(self, registry):
        r = registry
        self.requests = Counter("servelm_lora_requests_total",
                                "Finished requests per LoRA adapter", ["adapter"], registry=r)
        self.prompt_tokens = Counter("servelm_lora_prompt_tokens_total",
                                     "Prompt tokens of finished requests per LoRA adapter",
                                     ["adapter"], registry=r)
        self.generation_tokens = Counter("servelm_lora_generation_tokens_total",
                                         "Tokens generated per LoRA adapter", ["adapter"],
                                         registry=r)
        self.loads = Counter("servelm_lora_loads_total",
                             "LoRA adapters copied into a slot", registry=r)
        self.evictions = Counter("servelm_lora_evictions_total",
                                 "LoRA adapters evicted from a slot for another", registry=r)
        self.adapters = Gauge("servelm_lora_adapters", "LoRA adapters loaded", registry=r)
        self.resident = Gauge("servelm_lora_adapters_resident",
                              "LoRA adapters in a slot", registry=r)
        self._last = (0, 0)

    def record_request(self, adapter: str, num_prompt_tokens: int,
                       num_generated_tokens: int) -> None:
        self.requests.labels(adapter).inc()
        self.prompt_tokens.labels(adapter).inc(num_prompt_tokens)
        self.generation_tokens.labels(adapter).inc(num_generated_tokens)

    def observe_step(self, report) -> None:
        """From the engine's StepReport (cumulative counters: the increments are added)."""
        loads, evictions = report.lora_num_loads, report.lora_num_evictions
        last_loads, last_evictions = self._last
        if loads > last_loads:
            self.loads.inc(loads - last_loads)
        if evictions > last_evictions:
            self.evictions.inc(evictions - last_evictions)
        self._last = (max(loads, last_loads), max(evictions, last_evictions))
        self.adapters.set(report.lora_num_adapters)
        self.resident.set(report.lora_num_resident)


__all__ = ["LoraMetrics"]
