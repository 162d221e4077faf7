"""Where the runtime's bytes live: the device arena (`arena`), the copy engine that fills it
(`copy_engine`), the checkpoint's weights (`weights`), the paged host KV pool (`kv`) and the
policies that stream weights and KV into the arena during a step (`streaming`)."""
