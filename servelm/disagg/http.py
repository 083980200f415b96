"""The HTTP face of disaggregation: how a router tells a worker a request's part in a KV
transfer, and how a worker says what it is.

Owns: the `x-servelm-kv-transfer` request header (JSON: transfer_id, role, source) and its
parsing into KVTransferParams (a malformed one is a 400 naming the header), and the body of
`GET /v1/disagg` (role, transport, KV address). Never: reads the request body.
"""

from __future__ import annotations

import json

from servelm.protocol import InvalidParameterError, KVTransferParams

HEADER = "x-servelm-kv-transfer"
ROLES = ("prefill", "decode")


def header_value(transfer_id: str, role: str, source: str = "") -> str:
    return json.dumps({"transfer_id": transfer_id, "role": role, "source": source})


def kv_transfer_from_headers(headers) -> KVTransferParams | None:
    raw = headers.get(HEADER)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
        tid, role, source = obj["transfer_id"], obj["role"], obj.get("source", "")
    except (ValueError, KeyError, TypeError):
        raise InvalidParameterError(f"header {HEADER} must be JSON with transfer_id, role "
                                    "and source", param=HEADER) from None
    if not isinstance(tid, str) or not tid or len(tid) > 200:
        raise InvalidParameterError(f"{HEADER}: transfer_id must be a non-empty string",
                                    param=HEADER)
    if role not in ROLES:
        raise InvalidParameterError(f"{HEADER}: role must be prefill or decode, got {role!r}",
                                    param=HEADER)
    if role == "decode" and (not isinstance(source, str) or not source):
        raise InvalidParameterError(f"{HEADER}: a decode request names its prefill worker's "
                                    "KV address in source", param=HEADER)
    return KVTransferParams(tid, role, source if isinstance(source, str) else "")


def per_prompt(kt: KVTransferParams | None, index: int) -> KVTransferParams | None:
    """The transfer of a request's index-th prompt (both workers number prompts alike)."""
    if kt is None:
        return None
    return KVTransferParams(f"{kt.transfer_id}/{index}", kt.role, kt.source)


def info(engine_args) -> dict:
    return {"role": engine_args.disagg_role, "kv_transport": engine_args.kv_transport,
            "kv_address": engine_args.kv_address}
