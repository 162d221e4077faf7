"""Where the runtime's bytes live: the device arena (`arena`), the copy engine that fills it
(`copy_engine`: two lanes, race amplification for tests), the checkpoint's weights
(`weights`), the paged host KV pool (`kv`, fitted to the run machine's memory), the policies
that stream weights and KV into the arena during a step (`streaming`), page-locked host memory
(`pinned`), the rule for how streamed weights reach the device (`weight_path`, shared with the
compiler) and the pinning of the streamed weights by that rule (`pinned_weights`)."""
