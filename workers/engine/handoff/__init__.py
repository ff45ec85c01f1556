"""The engine's two sides of a prefill -> decode KV handoff.

- prefill_exports.py (`PrefillExports`): a prefill-only request's blocks, held for
  export until decode confirms or a deadline passes;
- decode_imports.py (`DecodeImports`): a prefilled request checked, its cached prefix
  pinned, the rest imported once blocks are free;
- handle.py (`KVHandle`): what prefill tells decode about the request;
- decode_pull.py and pull_budget.py: decode pulls the KV ahead of its import, within a
  byte budget.

The bytes themselves (layout, copies, transports) are `workers/kv`'s; `LLMEngine` owns
one of each side and `workers.engine` exports the types serving code uses.

The protocol, as a serving layer drives it:

1. prefill: `add_request(..., prefill_only=True)`, step until its output is
   finished; it carries a `handoff` handle (unless it has a finish_reason: the
   first token ended the request, there is nothing to hand off);
2. decode: `k = cached_prefix_blocks(handle.block_hashes, prompt, cache_salt)`;
3. prefill: `handle, parts = export_kv(request_id, skip_blocks=k)`;
4. decode: `add_prefilled_request(request_id, prompt, params, handle, parts,
   cache_salt)`; on StalePrefixError (decode evicted some of those k blocks
   meanwhile) go back to 3 with `skip_blocks=error.num_cached_blocks`;
5. prefill: `release_handoff(request_id)` (or it expires);
6. decode: step as usual. Its first output repeats the handed-over token (same
   token and text), so a caller that streamed prefill's output skips it.
"""
