"""The serving side of the KV handoff, on a decode replica: the decode-driven handoff and
its fallbacks (decode_handoff.py), when to stop asking for direct-transport exports
(transport_fallback.py), and when to prefill a prompt here instead (selective_disaggregation.py)."""
