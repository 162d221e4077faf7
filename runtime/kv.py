from moecc_runtime.scheduler.blocks import KVCacheFull  # noqa: F401  shim, removed by the lead
