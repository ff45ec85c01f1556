"""The KV cache's shape and its bytes between processes: how layers share the pool's
blocks (`KVCacheGroups`, the hybrid cache), the blocks' layout and data (`KVLayout`,
`KVBlocks`), the copies in and out of a paged cache, and the transports that carry them
(Ray's object store, NIXL through Ray Direct Transport). Below both the runner, whose
ranks hold the cache, and the engine, which decides what moves; serving code reaches
these types through `workers.engine`."""
